/*
 * moed_list — the one intrusive doubly-linked list (libuv's src/queue.h, with our prefix).
 *
 * A list is a moed_list head; an element embeds a moed_list node and is found back from it with
 * moed_list_data. The list is circular through its head, so insertion and removal touch no
 * special case and never allocate: what a module keeps on a list (queued requests, open calls)
 * costs it nothing but the node. Nothing here locks; the owner of the list does.
 */
#ifndef MOED_LIST_H
#define MOED_LIST_H

#include <stddef.h>

typedef struct moed_list {
    struct moed_list *next, *prev;
} moed_list;

/* The struct of type `type` whose member `member` is at ptr. */
#define moed_container_of(ptr, type, member) ((type *)((char *)(ptr)-offsetof(type, member)))
#define moed_list_data(node, type, member)   moed_container_of(node, type, member)

/* Every node of h in order; the loop body must not remove q (take q's next first for that). */
#define moed_list_foreach(q, h) for ((q) = (h)->next; (q) != (h); (q) = (q)->next)

static inline void moed_list_init(moed_list *h)
{
    h->next = h;
    h->prev = h;
}

static inline int moed_list_empty(const moed_list *h)
{
    return h == h->next;
}

/* The first node; h itself when the list is empty. */
static inline moed_list *moed_list_head(const moed_list *h)
{
    return h->next;
}

static inline void moed_list_insert_head(moed_list *h, moed_list *q)
{
    q->next = h->next;
    q->prev = h;
    q->next->prev = q;
    h->next = q;
}

static inline void moed_list_insert_tail(moed_list *h, moed_list *q)
{
    q->next = h;
    q->prev = h->prev;
    q->prev->next = q;
    h->prev = q;
}

static inline void moed_list_remove(moed_list *q)
{
    q->prev->next = q->next;
    q->next->prev = q->prev;
}

#endif
