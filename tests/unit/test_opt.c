/*
 * test_opt — common/moed_opt.c, the option table of every program: defaults are
 * stored before argv, every kind of value is parsed and bounded, "--name=value" and unique prefixes
 * work, each bad word is a usage error (exit 2) whose message names the flag, options are tied to
 * their command, and --help is printed from the same rows (defaults, sections, continuation lines).
 */
#include "check.h"
#include "moed_opt.h"

#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef struct args {
    const char *name, *mode;
    long long count, layer, layers;
    double ratio;
    int fast, parity;
} args;

static int parse_parity(const char *v, void *field)
{
    if (strcmp(v, "even") && strcmp(v, "odd")) return -1;
    *(int *)field = !strcmp(v, "odd");
    return 0;
}

#define F(m) offsetof(args, m)

static const moed_opt options[] = {
    MOED_OPT_SECTION_ROW("general:", NULL),
    MOED_OPT_STR_ROW("name", F(name), "N", "anon", NULL, "who"),
    MOED_OPT_I64_ROW("count", F(count), "C", 1, 10, "3", "give 1 to 10", NULL, "how many"),
    MOED_OPT_NUM_ROW("ratio", F(ratio), "R", 0, 1, NULL, "give a share in [0, 1]", NULL,
                     "a share\nover two lines"),
    MOED_OPT_FLAG_ROW("fast", F(fast), 7, NULL, "go fast"),
    MOED_OPT_HELP_ROW("this text"),
    MOED_OPT_I64_ROW("layer", F(layer), "L", 0, 99, NULL, "give 0 to 99", "run", "one layer"),
    MOED_OPT_I64_ROW("layers", F(layers), "L", 0, 99, NULL, "give 0 to 99", "run", "more layers"),
    MOED_OPT_CUSTOM_ROW("parity", F(parity), "P", parse_parity, NULL, "use even or odd", "run",
                        "even or odd"),
    MOED_OPT_STR_ROW("mode", F(mode), "M", "a-rather-long-default-value-that-does-not-fit-the-line",
                     "run", "a mode whose help and default together run past the width"),
};

static const moed_opt_cmd commands[] = {
    { .name = NULL, .head = "usage: tool COMMAND\n", .tail = "bye\n" },
    { .name = "run", .head = "usage: tool run\n" },
    { .name = "stop", .head = "usage: tool stop\n" },
};

static const moed_opt_spec spec = { .prog = "tool",
                                    .hint = "tool --help",
                                    .opts = options,
                                    .n_opts = sizeof options / sizeof options[0],
                                    .cmds = commands,
                                    .n_cmds = sizeof commands / sizeof commands[0] };

static char stderr_text[4096];

/* Parses the words (argv[0] added); what moed_opt_parse printed on stderr lands in stderr_text. */
static bool parse(args *a, moed_opt_parsed *p, int *rc, int n, const char *const *words)
{
    char *argv[16] = { "tool" };
    for (int i = 0; i < n; i++) argv[i + 1] = (char *)words[i];
    memset(a, 0, sizeof *a);
    fflush(stderr);
    FILE *cap = tmpfile();
    int saved = dup(2);
    dup2(fileno(cap), 2);
    bool ok = moed_opt_parse(&spec, n + 1, argv, a, p, rc);
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    rewind(cap);
    size_t got = fread(stderr_text, 1, sizeof stderr_text - 1, cap);
    stderr_text[got] = 0;
    fclose(cap);
    return ok;
}

#define PARSE(a, p, rc, ...)                                                                       \
    parse(a, p, rc, sizeof((const char *[]){ __VA_ARGS__ }) / sizeof(const char *),                \
          (const char *[]){ __VA_ARGS__ })

static void test_values_and_defaults(void)
{
    args a;
    moed_opt_parsed p;
    int rc = -1;
    CHECK(PARSE(&a, &p, &rc, "run"));
    CHECK(!strcmp(p.command, "run"));
    CHECK(!strcmp(a.name, "anon") && a.count == 3 && a.ratio == 0 && !a.fast);
    CHECK(!moed_opt_given(&spec, &p, "count") && !moed_opt_given(&spec, &p, "name"));

    CHECK(PARSE(&a, &p, &rc, "--name", "-x", "--count=10", "run", "--ratio", "0.25", "--fast",
                "--parity", "odd", "--layers", "4"));
    CHECK(!strcmp(a.name, "-x")); /* a value may start with '-' */
    CHECK(a.count == 10 && a.ratio == 0.25 && a.fast == 7 && a.parity == 1 && a.layers == 4);
    CHECK(moed_opt_given(&spec, &p, "count") && moed_opt_given(&spec, &p, "fast"));
    CHECK(!moed_opt_given(&spec, &p, "layer") && moed_opt_given(&spec, &p, "layers"));

    /* a unique prefix stands for its option; an exact name wins over a longer one */
    CHECK(PARSE(&a, &p, &rc, "run", "--cou", "2", "--layer", "5", "--par=even"));
    CHECK(a.count == 2 && a.layer == 5 && a.layers == 0 && a.parity == 0);
    /* after "--" every word is positional */
    CHECK(!PARSE(&a, &p, &rc, "--", "--fast"));
    CHECK_EQ_INT(rc, MOED_OPT_EXIT_USAGE);
    CHECK(strstr(stderr_text, "unknown command '--fast'"));
}

static void test_usage_errors(void)
{
    static const struct {
        const char *words[4];
        int n;
        const char *says;
    } cases[] = {
        { { "run", "--count", "11" }, 3, "tool: --count 11: give 1 to 10" },
        { { "run", "--count", "3x" }, 3, "--count 3x: give 1 to 10" },
        { { "run", "--count", "" }, 3, "--count : give 1 to 10" },
        { { "run", "--ratio", "nan" }, 3, "--ratio nan: give a share in [0, 1]" },
        { { "run", "--ratio", "inf" }, 3, "--ratio inf: give a share" },
        { { "run", "--parity", "3" }, 3, "--parity 3: use even or odd" },
        { { "run", "--count" }, 2, "--count needs a value" },
        { { "run", "--fast=yes" }, 2, "--fast takes no value" },
        { { "run", "--bogus" }, 2, "unknown option --bogus" },
        { { "run", "--bogus=1" }, 2, "unknown option --bogus\n" },
        { { "run", "-c", "1" }, 3, "unknown option -c" },
        { { "run", "--la", "1" }, 3, "ambiguous option --la" },
        { { "run", "extra" }, 2, "unexpected argument 'extra'" },
        { { "walk" }, 1, "unknown command 'walk'" },
        { { "stop", "--layer", "1" }, 3, "--layer belongs to 'run', not 'stop'" },
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        args a;
        moed_opt_parsed p;
        int rc = -1;
        CHECK_MSG(!parse(&a, &p, &rc, cases[i].n, cases[i].words), "case %zu", i);
        CHECK_EQ_INT(rc, MOED_OPT_EXIT_USAGE);
        CHECK_MSG(strstr(stderr_text, cases[i].says), "case %zu: %s", i, stderr_text);
        CHECK_MSG(strstr(stderr_text, "(tool --help)\n"), "case %zu: no hint", i);
    }
    /* no command: the main help on stderr, exit 2 */
    args a;
    moed_opt_parsed p;
    int rc = -1;
    CHECK(!parse(&a, &p, &rc, 0, NULL));
    CHECK_EQ_INT(rc, MOED_OPT_EXIT_USAGE);
    CHECK(strstr(stderr_text, "usage: tool COMMAND\n"));
}

static char *help_of(const char *command)
{
    char *text = NULL;
    size_t n = 0;
    FILE *f = open_memstream(&text, &n);
    moed_opt_help(&spec, command, f);
    fclose(f);
    return text;
}

static void test_help(void)
{
    char *main_help = help_of(NULL);
    CHECK_MSG(!strcmp(main_help, "usage: tool COMMAND\n"
                                 "\n"
                                 "general:\n"
                                 "  --name N              who (default anon)\n"
                                 "  --count C             how many (default 3)\n"
                                 "  --ratio R             a share\n"
                                 "                        over two lines\n"
                                 "  --fast                go fast\n"
                                 "  --help                this text\n"
                                 "\n"
                                 "bye\n"),
              "%s", main_help);
    char *run_help = help_of("run");
    CHECK_MSG(!strcmp(run_help, "usage: tool run\n"
                                "  --layer L             one layer\n"
                                "  --layers L            more layers\n"
                                "  --parity P            even or odd\n"
                                "  --mode M              a mode whose help and default together "
                                "run past the width\n"
                                "                        (default "
                                "a-rather-long-default-value-that-does-not-fit-the-line)\n"),
              "%s", run_help);
    free(main_help);
    free(run_help);
}

int main(void)
{
    test_values_and_defaults();
    test_usage_errors();
    test_help();
    return check_status("test_opt");
}
