/*
 * test_list — the intrusive list: order of insertion at either end, removal from the middle and
 * the ends, emptiness, and finding an element back from its node.
 */
#include "check.h"
#include "moed_list.h"

#include <string.h>

typedef struct elem {
    int value;
    moed_list node;
} elem;

/* The list's values in order, as digits ("312"), so a wrong link shows as a wrong string. */
static void order(const moed_list *h, char *out)
{
    const moed_list *q;
    moed_list_foreach (q, h) *out++ = (char)('0' + moed_list_data(q, elem, node)->value);
    *out = 0;
}

static void check_order(const moed_list *h, const char *want)
{
    char got[16];
    order(h, got);
    CHECK_MSG(!strcmp(got, want), "order %s, want %s", got, want);
    /* The backward links must agree with the forward ones. */
    size_t n = strlen(want);
    const moed_list *q = h->prev;
    for (size_t i = n; i-- > 0; q = q->prev)
        CHECK_EQ_INT(moed_list_data(q, elem, node)->value, want[i] - '0');
    CHECK(q == h);
}

int main(void)
{
    elem e[5];
    moed_list h;
    moed_list_init(&h);
    CHECK(moed_list_empty(&h));
    CHECK(moed_list_head(&h) == &h);
    check_order(&h, "");
    for (int i = 0; i < 5; i++) e[i].value = i;
    moed_list_insert_tail(&h, &e[1].node);
    moed_list_insert_tail(&h, &e[2].node);
    moed_list_insert_head(&h, &e[0].node);
    moed_list_insert_tail(&h, &e[3].node);
    moed_list_insert_head(&h, &e[4].node);
    CHECK(!moed_list_empty(&h));
    check_order(&h, "40123");
    CHECK(moed_list_data(moed_list_head(&h), elem, node) == &e[4]);
    moed_list_remove(&e[1].node); /* middle */
    check_order(&h, "4023");
    moed_list_remove(&e[4].node); /* head */
    check_order(&h, "023");
    moed_list_remove(&e[3].node); /* tail */
    check_order(&h, "02");
    moed_list_remove(&e[0].node);
    moed_list_remove(&e[2].node);
    CHECK(moed_list_empty(&h));
    check_order(&h, "");
    moed_list_insert_tail(&h, &e[3].node); /* a removed node can go on again */
    check_order(&h, "3");
    return check_status("test_list");
}
