/*
 * test_expert_load — --expert-load's parser and its checks against a model (expert_load.h).
 *
 * A table of files: good ones (moed's own /metrics page, labels in either order, blanks and a
 * trailing comma, float and integer values, a timestamp, comments, other metrics and metrics
 * whose names only start like this one, CRLF line ends, no final newline, an empty file) with
 * the entries they give; and every refusal (a bad, negative, NaN or infinite value, an unknown,
 * repeated or missing label, a label that is no number or is over the largest id, an unquoted or
 * unclosed value, text after the value, a line of the metric over the limit, a NUL byte, a
 * (layer, expert) given twice), each with the line its message must name and a word of what is
 * wrong. Then the model checks (a layer not in the model, ignored with --layers; an expert out of
 * range, naming the range; a shard's held experts picked out; all zeros and absent layers giving
 * no load) and the file reader (a missing file, a directory, a FIFO refused without blocking, a
 * file over the size limit).
 */
#include "check.h"
#include "expert_load.h"

#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* The head of a page of moed's /metrics, as server/metrics.c writes it. */
#define PAGE_HEAD                                                                                  \
    "# HELP moed_tokens_total Tokens computed (rows of hidden, over every launch).\n"              \
    "# TYPE moed_tokens_total counter\n"                                                           \
    "moed_tokens_total 4096\n"                                                                     \
    "# HELP moed_expert_tokens_total (token, expert) pairs computed, by layer and expert.\n"       \
    "# TYPE moed_expert_tokens_total counter\n"

typedef struct good_case {
    const char *name, *text;
    int n;             /* entries */
    int layer, expert; /* of the first entry (sorted), when n > 0 */
    double tokens;     /* its value */
} good_case;

static const good_case goods[] = {
    { "moed's page",
      PAGE_HEAD "moed_expert_tokens_total{layer=\"3\",expert=\"0\"} 10\n"
                "moed_expert_tokens_total{layer=\"3\",expert=\"1\"} 0\n"
                "moed_expert_tokens_total{layer=\"4\",expert=\"0\"} 7\n"
                "# HELP moed_request_bytes_total Bytes.\nmoed_request_bytes_total 12\n",
      3, 3, 0, 10 },
    { "labels in the other order", "moed_expert_tokens_total{expert=\"5\",layer=\"2\"} 3\n", 1, 2,
      5, 3 },
    { "blanks and a trailing comma",
      "  moed_expert_tokens_total { layer = \"1\" ,\texpert=\"2\", }  42  \n", 1, 1, 2, 42 },
    { "a float value", "moed_expert_tokens_total{layer=\"0\",expert=\"0\"} 1.5e+06\n", 1, 0, 0,
      1.5e6 },
    { "a decimal value", "moed_expert_tokens_total{layer=\"0\",expert=\"0\"} 0.25\n", 1, 0, 0,
      0.25 },
    { "a counter past 2^53",
      "moed_expert_tokens_total{layer=\"0\",expert=\"0\"} 18446744073709551615\n", 1, 0, 0,
      18446744073709551615.0 },
    { "minus zero", "moed_expert_tokens_total{layer=\"0\",expert=\"0\"} -0\n", 1, 0, 0, 0 },
    { "a timestamp", "moed_expert_tokens_total{layer=\"0\",expert=\"1\"} 9 1712345678901\n", 1, 0,
      1, 9 },
    { "leading zeros", "moed_expert_tokens_total{layer=\"007\",expert=\"010\"} 1\n", 1, 7, 10, 1 },
    { "the largest ids", "moed_expert_tokens_total{layer=\"65535\",expert=\"65535\"} 1\n", 1, 65535,
      65535, 1 },
    { "CRLF line ends",
      "# TYPE moed_expert_tokens_total counter\r\n"
      "moed_expert_tokens_total{layer=\"1\",expert=\"1\"} 2\r\n\r\n"
      "moed_expert_tokens_total{layer=\"1\",expert=\"0\"} 1\r\n",
      2, 1, 0, 1 },
    { "no final newline", "moed_expert_tokens_total{layer=\"0\",expert=\"3\"} 8", 1, 0, 3, 8 },
    { "look-alike metrics skipped",
      "moed_expert_tokens_total_created{layer=\"x\"} nan\n"
      "moed_expert_tokens{layer=\"1\",expert=\"1\"} -5\n"
      "moed_expert_tokens_total:rate5m{layer=\"1\"} 3\n"
      "other_metric{layer=\"1\",expert=\"1\",job=\"x\"} +Inf\n"
      "# moed_expert_tokens_total{layer=\"1\",expert=\"1\"} bad\n",
      0, 0, 0, 0 },
    { "a long line of another metric",
      "other{x=\"" /* over the limit of this metric's lines: skipped all the same */
      "0123456789012345678901234567890123456789012345678901234567890123456789012345678901234567"
      "0123456789012345678901234567890123456789012345678901234567890123456789012345678901234567"
      "0123456789012345678901234567890123456789012345678901234567890123456789012345678901234567"
      "0123456789012345678901234567890123456789012345678901234567890123456789012345678901234567"
      "0123456789012345678901234567890123456789012345678901234567890123456789012345678901234567"
      "0123456789012345678901234567890123456789012345678901234567890123456789012345678901234567"
      "0123456789012345678901234567890123456789012345678901234567890123456789012345678901234567"
      "0123456789012345678901234567890123456789012345678901234567890123456789012345678901234567"
      "0123456789012345678901234567890123456789012345678901234567890123456789012345678901234567"
      "0123456789012345678901234567890123456789012345678901234567890123456789012345678901234567"
      "0123456789012345678901234567890123456789012345678901234567890123456789012345678901234567"
      "0123456789012345678901234567890123456789012345678901234567890123456789012345678901234567"
      "\"} 1\n",
      0, 0, 0, 0 },
    { "an empty file", "", 0, 0, 0, 0 },
    { "comments and blank lines only", "# nothing\n\n   \n\t\n# HELP x y\n", 0, 0, 0, 0 },
};

typedef struct bad_case {
    const char *name, *text;
    int line;         /* the line the message must name */
    const char *word; /* and a phrase of what is wrong */
} bad_case;

#define S(labels, value) "moed_expert_tokens_total{" labels "} " value "\n"
#define OK               S("layer=\"0\",expert=\"0\"", "1")

static const bad_case bads[] = {
    { "not a number", OK S("layer=\"0\",expert=\"1\"", "12abc"), 2, "is not a number" },
    { "hex", S("layer=\"0\",expert=\"1\"", "0x10"), 1, "is not a number" },
    { "only a dot", S("layer=\"0\",expert=\"1\"", "."), 1, "is not a number" },
    { "negative", PAGE_HEAD S("layer=\"0\",expert=\"1\"", "-3"), 6, "is negative" },
    { "negative float", S("layer=\"0\",expert=\"1\"", "-1e-3"), 1, "is negative" },
    { "NaN", OK OK S("layer=\"0\",expert=\"2\"", "NaN"), 3, "not a finite number" },
    { "+Inf", S("layer=\"0\",expert=\"1\"", "+Inf"), 1, "not a finite number" },
    { "Inf", S("layer=\"0\",expert=\"1\"", "Inf"), 1, "not a finite number" },
    { "overflow", S("layer=\"0\",expert=\"1\"", "1e999"), 1, "out of range" },
    { "a value too long to copy",
      S("layer=\"0\",expert=\"1\"", "1111111111111111111111111111111111111111111111111111111111111"
                                    "1111111111"),
      1, "is not a number" },
    { "no value", "moed_expert_tokens_total{layer=\"0\",expert=\"1\"}\n", 1, "no value" },
    { "unknown label", OK S("layer=\"0\",expert=\"1\",instance=\"h:1\"", "1"), 2,
      "unknown label 'instance'" },
    { "unknown label first", S("job=\"moed\",layer=\"0\",expert=\"1\"", "1"), 1,
      "unknown label 'job'" },
    { "missing expert", S("layer=\"0\"", "1"), 1, "label expert is missing" },
    { "missing layer", "\n" S("expert=\"0\"", "1"), 2, "label layer is missing" },
    { "no labels", "moed_expert_tokens_total 5\n", 1, "without its labels" },
    { "launches twice", OK "moed_batch_tokens_count 4\nmoed_batch_tokens_count 4\n", 3,
      "moed_batch_tokens_count again, first given on line 2" },
    { "launches negative", "moed_batch_tokens_count -4\n", 1, "is negative" },
    { "launches with labels", "moed_batch_tokens_count{le=\"8\"} 4\n", 1,
      "expected moed_batch_tokens_count COUNT" },
    { "empty labels", S("", "5"), 1, "label layer is missing" },
    { "label twice", S("layer=\"0\",layer=\"1\",expert=\"0\"", "1"), 1, "given twice" },
    { "layer not a number", S("layer=\"x\",expert=\"0\"", "1"), 1, "layer=\"x\" is not a decimal" },
    { "layer negative", S("layer=\"-1\",expert=\"0\"", "1"), 1, "is not a decimal number" },
    { "layer empty", S("layer=\"\",expert=\"0\"", "1"), 1, "is not a decimal number" },
    { "layer over the largest id", S("layer=\"65536\",expert=\"0\"", "1"), 1, "from 0 to 65535" },
    { "expert over the largest id", S("layer=\"1\",expert=\"99999999999\"", "1"), 1,
      "from 0 to 65535" },
    { "unquoted", S("layer=0,expert=\"0\"", "1"), 1, "not in double quotes" },
    { "unclosed quote", "moed_expert_tokens_total{layer=\"0,expert=0} 1\n", 1, "no closing quote" },
    { "no closing brace", "moed_expert_tokens_total{layer=\"0\",expert=\"0\" 1\n", 1,
      "expected ',' or '}'" },
    { "no equals", S("layer \"0\",expert=\"0\"", "1"), 1, "expected '='" },
    { "garbage in labels", S("layer=\"0\",,expert=\"0\"", "1"), 1, "expected a label name" },
    { "text after the value", S("layer=\"0\",expert=\"0\"", "1 2 3"), 1, "after the value" },
    { "a word after the value", S("layer=\"0\",expert=\"0\"", "1 # comment"), 1,
      "after the value" },
    { "a line too long",
      "moed_expert_tokens_total{layer=\"0\",expert=\"0\"}                                       "
      "                                                                                          "
      "                                                                                          "
      "                                                                                          "
      "                                                                                          "
      "                                                                                          "
      "                                                                                          "
      "                                                                                          "
      "                                                                                          "
      "                                                                                          "
      "                                                                                          "
      "                                                                            1\n",
      1, "a line of moed_expert_tokens_total is at most 1024" },
    { "duplicate", OK "moed_expert_tokens_total{expert=\"0\",layer=\"0\"} 5\n", 2,
      "layer 0 expert 0 again, first given on line 1" },
    { "duplicate, the first in file order",
      S("layer=\"9\",expert=\"9\"", "1") OK OK S("layer=\"9\",expert=\"9\"", "1"), 3,
      "layer 0 expert 0 again, first given on line 2" },
    { "CRLF and a bad line", "# x\r\n" OK "\r\n" S("layer=\"1\",expert=\"0\"", "oops"), 4,
      "'oops' is not a number" },
};

/* A file of n bytes with a NUL: the table's strings cannot hold one. */
static void test_nul(void)
{
    static const char text[] = "# a\nmoed_expert_tokens_total{layer=\"0\",expert=\"0\"} 1\0\n";
    moed_expert_load l;
    moed_error err = { 0 };
    CHECK_EQ_INT(moed_expert_load_parse(text, sizeof text - 1, "nul", &l, &err), MOED_EINVAL);
    CHECK_MSG(strstr(err.msg, "nul line 2: a NUL byte"), "%s", err.msg);
    moed_expert_load_free(&l);
}

static void test_goods(void)
{
    for (size_t i = 0; i < sizeof goods / sizeof goods[0]; i++) {
        const good_case *c = &goods[i];
        moed_expert_load l;
        moed_error err = { 0 };
        int rc = moed_expert_load_parse(c->text, strlen(c->text), "good.prom", &l, &err);
        CHECK_MSG(rc == 0, "%s: refused: %s", c->name, err.msg);
        CHECK_MSG(l.n == c->n, "%s: %d entries, expected %d", c->name, l.n, c->n);
        if (!rc && c->n && l.n)
            CHECK_MSG(l.v[0].layer == c->layer && l.v[0].expert == c->expert &&
                          l.v[0].tokens == c->tokens,
                      "%s: first entry layer %d expert %d tokens %.17g", c->name, l.v[0].layer,
                      l.v[0].expert, l.v[0].tokens);
        for (int k = 1; !rc && k < l.n; k++) /* sorted by layer, then expert */
            CHECK(l.v[k - 1].layer < l.v[k].layer ||
                  (l.v[k - 1].layer == l.v[k].layer && l.v[k - 1].expert < l.v[k].expert));
        moed_expert_load_free(&l);
    }
    /* Lines are counted as the file has them: the entry of line 4 says so. */
    moed_expert_load l;
    moed_error err = { 0 };
    const char *t = goods[0].text;
    CHECK_EQ_INT(moed_expert_load_parse(t, strlen(t), "x", &l, &err), 0);
    CHECK(l.n == 3 && l.v[0].line == 6 && l.v[1].line == 7 && l.v[2].line == 8);
    moed_expert_load_free(&l);
}

/* The launches' count: read from the page's histogram, shared out over the layers it names; 0
 * without it; the histogram's other lines (buckets, sum) skipped. */
static void test_launches(void)
{
    const char *t = PAGE_HEAD "moed_expert_tokens_total{layer=\"3\",expert=\"0\"} 10\n"
                              "moed_expert_tokens_total{layer=\"4\",expert=\"0\"} 7\n"
                              "moed_batch_tokens_bucket{le=\"8\"} 100\n"
                              "moed_batch_tokens_sum 2400\n"
                              "moed_batch_tokens_count 120\n";
    moed_expert_load l;
    moed_error err = { 0 };
    CHECK_EQ_INT(moed_expert_load_parse(t, strlen(t), "x", &l, &err), 0);
    CHECK(l.launches == 120 && l.launches_line == 10);
    CHECK(moed_expert_load_launches(&l) == 60);
    moed_expert_load_free(&l);
    CHECK_EQ_INT(moed_expert_load_parse(goods[0].text, strlen(goods[0].text), "x", &l, &err), 0);
    CHECK(moed_expert_load_launches(&l) == 0);
    moed_expert_load_free(&l);
}

static void test_bads(void)
{
    for (size_t i = 0; i < sizeof bads / sizeof bads[0]; i++) {
        const bad_case *c = &bads[i];
        moed_expert_load l;
        moed_error err = { 0 };
        char want[64];
        int rc =
            moed_expert_load_parse(c->text, strlen(c->text), "--expert-load bad.prom", &l, &err);
        snprintf(want, sizeof want, "--expert-load bad.prom line %d: ", c->line);
        CHECK_MSG(rc == MOED_EINVAL, "%s: rc %d", c->name, rc);
        CHECK_MSG(!strncmp(err.msg, want, strlen(want)),
                  "%s: message '%s', expected it to start "
                  "'%s'",
                  c->name, err.msg, want);
        CHECK_MSG(strstr(err.msg, c->word), "%s: message '%s' lacks '%s'", c->name, err.msg,
                  c->word);
        moed_expert_load_free(&l);
    }
}

/* What a refusal quotes of the line is short and printable. */
static void test_excerpt(void)
{
    char text[400];
    snprintf(text, sizeof text,
             "moed_expert_tokens_total{layer=\"0\",expert=\"0\"} 1 "
             "\x1b[31mred\x07\xff%s\n",
             "abcdefghijklmnopqrstuvwxyzabcdefghijklmnopqrstuvwxyz");
    moed_expert_load l;
    moed_error err = { 0 };
    CHECK_EQ_INT(moed_expert_load_parse(text, strlen(text), "x", &l, &err), MOED_EINVAL);
    CHECK_MSG(strstr(err.msg, "'?[31mred??abcdefghijklmn...'"), "%s", err.msg);
    for (const char *p = err.msg; *p; p++) CHECK((unsigned char)*p >= 0x20 && *p != 0x7f);
    CHECK(!strstr(err.msg, "nopqrstuvwxyz"));
    moed_expert_load_free(&l);
}

static void parse_ok(const char *text, moed_expert_load *l)
{
    moed_error err = { 0 };
    int rc = moed_expert_load_parse(text, strlen(text), "--expert-load m.prom", l, &err);
    CHECK_MSG(rc == 0, "%s", err.msg);
}

static void test_model(void)
{
    moed_expert_load l;
    moed_error err = { 0 };
    parse_ok("moed_expert_tokens_total{layer=\"3\",expert=\"0\"} 10\n"
             "moed_expert_tokens_total{layer=\"3\",expert=\"2\"} 30\n"
             "moed_expert_tokens_total{layer=\"3\",expert=\"3\"} 0\n"
             "moed_expert_tokens_total{layer=\"5\",expert=\"1\"} 0\n"
             "moed_expert_tokens_total{layer=\"5\",expert=\"0\"} 0\n"
             "moed_expert_tokens_total{layer=\"9\",expert=\"0\"} 1\n",
             &l);
    const int have[] = { 3, 4, 5 };
    int ignored = -1;
    /* Layer 9 is no MoE layer of the model. */
    CHECK_EQ_INT(moed_expert_load_check(&l, have, 3, "m", false, &ignored, &err), MOED_EINVAL);
    CHECK_MSG(strstr(err.msg, "--expert-load m.prom line 6: layer 9 is not a MoE layer of m (it "
                              "has 3 MoE layers, from 3 to 5)"),
              "%s", err.msg);
    CHECK_EQ_INT(ignored, 1);
    /* Unless the daemon serves some layers only: then it is skipped. */
    CHECK_EQ_INT(moed_expert_load_check(&l, have, 3, "m", true, &ignored, &err), 0);
    CHECK_EQ_INT(ignored, 1);
    const int all[] = { 3, 4, 5, 9 };
    CHECK_EQ_INT(moed_expert_load_check(&l, all, 4, "m", false, &ignored, &err), 0);
    CHECK_EQ_INT(ignored, 0);
    CHECK_EQ_INT(moed_expert_load_check(&l, NULL, 0, "m", false, NULL, &err), MOED_EINVAL);
    CHECK_MSG(strstr(err.msg, "line 1: layer 3: m has no MoE layer"), "%s", err.msg);

    double *v;
    int named;
    /* Every expert of layer 3 (4 of them); 1 is not in the file: 0. */
    CHECK_EQ_INT(moed_expert_load_layer(&l, 3, 4, NULL, 0, &v, &named, &err), 0);
    CHECK_EQ_INT(named, 3);
    CHECK(v && v[0] == 10 && v[1] == 0 && v[2] == 30 && v[3] == 0);
    free(v);
    /* A shard holding experts 1 and 2: its view's numbering. */
    const int32_t held[] = { 1, 2 };
    CHECK_EQ_INT(moed_expert_load_layer(&l, 3, 4, held, 2, &v, &named, &err), 0);
    CHECK(v && v[0] == 0 && v[1] == 30);
    free(v);
    /* A shard whose experts all count 0: no load, but the file names the layer. */
    const int32_t zeros[] = { 1, 3 };
    CHECK_EQ_INT(moed_expert_load_layer(&l, 3, 4, zeros, 2, &v, &named, &err), 0);
    CHECK(!v && named == 3);
    /* A layer whose counts are all 0, and one the file does not name. */
    CHECK_EQ_INT(moed_expert_load_layer(&l, 5, 2, NULL, 0, &v, &named, &err), 0);
    CHECK(!v && named == 2);
    CHECK_EQ_INT(moed_expert_load_layer(&l, 4, 8, NULL, 0, &v, &named, &err), 0);
    CHECK(!v && named == 0);
    /* An expert id past the layer's: named with its line and the range. */
    CHECK_EQ_INT(moed_expert_load_layer(&l, 3, 3, NULL, 0, &v, &named, &err), MOED_EINVAL);
    CHECK(!v);
    CHECK_MSG(strstr(err.msg, "--expert-load m.prom line 3: expert 3 of layer 3 is out of range: "
                              "the layer has 3 experts (0 to 2)"),
              "%s", err.msg);
    CHECK_EQ_INT(moed_expert_load_layer(&l, 3, 2, NULL, 0, &v, &named, &err), MOED_EINVAL);
    CHECK_MSG(strstr(err.msg, "line 2: expert 2 of layer 3"), "%s", err.msg); /* first in file */
    moed_expert_load_free(&l);

    /* An empty file: no error, no layer gets a load. */
    parse_ok("", &l);
    CHECK_EQ_INT(l.n, 0);
    CHECK_EQ_INT(moed_expert_load_check(&l, have, 3, "m", false, &ignored, &err), 0);
    CHECK_EQ_INT(moed_expert_load_layer(&l, 3, 4, NULL, 0, &v, &named, &err), 0);
    CHECK(!v && named == 0);
    moed_expert_load_free(&l);
}

static char dir[] = "/tmp/test_expert_load.XXXXXX";

static const char *path_of(const char *name)
{
    static char buf[4][400];
    static int next;
    char *p = buf[next++ % 4];
    snprintf(p, 400, "%s/%s", dir, name);
    return p;
}

static void test_files(void)
{
    moed_expert_load l;
    moed_error err = { 0 };
    /* A good file. */
    FILE *f = fopen(path_of("load.prom"), "w");
    fputs(PAGE_HEAD "moed_expert_tokens_total{layer=\"1\",expert=\"0\"} 4\n", f);
    fclose(f);
    CHECK_EQ_INT(moed_expert_load_read(path_of("load.prom"), &l, &err), 0);
    CHECK(l.n == 1 && l.v[0].tokens == 4 && l.v[0].line == 6);
    CHECK(l.what && strstr(l.what, "--expert-load ") && strstr(l.what, "load.prom"));
    moed_expert_load_free(&l);
    /* A bad one names the path and the line. */
    f = fopen(path_of("bad.prom"), "w");
    fputs("\n\nmoed_expert_tokens_total{layer=\"1\",expert=\"0\"} -4\n", f);
    fclose(f);
    CHECK_EQ_INT(moed_expert_load_read(path_of("bad.prom"), &l, &err), MOED_EINVAL);
    char want[500];
    snprintf(want, sizeof want, "--expert-load %s line 3: ", path_of("bad.prom"));
    CHECK_MSG(!strncmp(err.msg, want, strlen(want)), "%s", err.msg);
    moed_expert_load_free(&l);
    /* Missing, a directory, a FIFO (refused at once: the test would hang otherwise). */
    CHECK_EQ_INT(moed_expert_load_read(path_of("missing.prom"), &l, &err), MOED_ENOTFOUND);
    CHECK_MSG(strstr(err.msg, "--expert-load") && strstr(err.msg, "missing.prom"), "%s", err.msg);
    moed_expert_load_free(&l);
    CHECK_EQ_INT(moed_expert_load_read(dir, &l, &err), MOED_EIO);
    CHECK_MSG(strstr(err.msg, "a directory"), "%s", err.msg);
    moed_expert_load_free(&l);
    CHECK_EQ_INT(mkfifo(path_of("fifo"), 0600), 0);
    CHECK_EQ_INT(moed_expert_load_read(path_of("fifo"), &l, &err), MOED_EIO);
    CHECK_MSG(strstr(err.msg, "FIFO"), "%s", err.msg);
    moed_expert_load_free(&l);
    /* Over the size limit: a sparse file, refused by its size before a byte is read. */
    int fd = open(path_of("big.prom"), O_CREAT | O_WRONLY | O_TRUNC, 0600);
    CHECK_EQ_INT(ftruncate(fd, (off_t)MOED_EXPERT_LOAD_MAX_FILE + 1), 0);
    close(fd);
    CHECK_EQ_INT(moed_expert_load_read(path_of("big.prom"), &l, &err), MOED_ETOOBIG);
    CHECK_MSG(strstr(err.msg, "over the"), "%s", err.msg);
    moed_expert_load_free(&l);
    const char *names[] = { "load.prom", "bad.prom", "fifo", "big.prom" };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) unlink(path_of(names[i]));
    rmdir(dir);
}

int main(void)
{
    if (!mkdtemp(dir)) return 1;
    test_goods();
    test_bads();
    test_launches();
    test_nul();
    test_excerpt();
    test_model();
    test_files();
    return check_status("test_expert_load");
}
