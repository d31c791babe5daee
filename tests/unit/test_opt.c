/*
 * test_opt — common/moed_opt.c, the option engine of every program. A tool's table (moectl's
 * shape): defaults are stored before argv, every kind of value is parsed and bounded,
 * "--name=value" and unique prefixes work, each bad word is a usage error (exit 2) whose message
 * names the flag, options are tied to their command, and --help is printed from the same rows
 * (defaults, sections, continuation lines). A daemon's table (moed's shape): exact names and
 * one-letter forms, the kinds only it uses (switch, int, bytes, choice, non-empty words, customs
 * with their own messages), a config file under the command line and over the defaults, its
 * errors naming file and line, --help and --version answered before any value is looked at, and
 * --help laid out at the spec's column without wrapping.
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
    int64_t count, layer, layers;
    double ratio;
    int fast, parity;
} args;

static int parse_parity(const char *v, void *field, moed_error *err)
{
    (void)err;
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

/* ---- a daemon's table ---- */

typedef struct daemon_args {
    const char *listen, *mode, *file, *config;
    int threads, verbose, level;
    int64_t bytes;
    char *text; /* the config file's, which values point into */
} daemon_args;

static const char *config_text; /* what the config file holds */

static int read_config(void *dst, const char *path, char **text, size_t *len, moed_error *err)
{
    daemon_args *a = dst;
    if (strcmp(path, "d.conf")) return moed_fail(err, MOED_EINVAL, "--config: no file %s", path);
    a->text = strdup(config_text);
    *text = a->text;
    *len = strlen(a->text);
    return 0;
}

static int parse_level(const char *v, void *field, moed_error *err)
{
    if (!strcmp(v, "loud")) return moed_fail(err, MOED_EINVAL, "'%s' is too loud", v);
    if (strcmp(v, "low") && strcmp(v, "high")) return -1; /* the kind of message: none, no want */
    *(int *)field = !strcmp(v, "high");
    return 0;
}

#define D(m) offsetof(daemon_args, m)

static const moed_opt daemon_options[] = {
    MOED_OPT_WORD_ROW("listen", D(listen), "ADDR", "127.0.0.1:1", NULL, "where"),
    MOED_OPT_CHOICE_ROW("mode", D(mode), "a|b", "a", NULL, "a mode"),
    MOED_OPT_INT_ROW("threads", D(threads), "N", 0, 64, "4", NULL, NULL, "threads"),
    MOED_OPT_BYTES_ROW("bytes", D(bytes), "BYTES", 16, 1 << 30, "1024", NULL, NULL, "bytes"),
    MOED_OPT_SWITCH_ROW("verbose", D(verbose), "0", NULL, "say more"),
    MOED_OPT_STR_ROW("file", D(file), "F", NULL, NULL, "a file, or empty"),
    MOED_OPT_CUSTOM_ROW("level", D(level), "low|high", parse_level, "low", NULL, NULL, "a level"),
    { .name = "config", .kind = MOED_OPT_CONFIG, .field = D(config), .arg = "FILE", .help = "c" },
    { .name = "help", .kind = MOED_OPT_HELP, .letter = 'h', .help = "this text" },
    { .name = "version", .kind = MOED_OPT_VERSION, .letter = 'V', .help = "the version" },
};

static const moed_opt_cmd daemon_cmd = { .head = "usage: d\n", .tail = "end\n" };

static const moed_opt_spec daemon_spec = {
    .prog = "d",
    .hint = "d --help",
    .version = "d 1.0",
    .opts = daemon_options,
    .n_opts = sizeof daemon_options / sizeof daemon_options[0],
    .cmds = &daemon_cmd,
    .n_cmds = 1,
    .exact = true,
    .help_column = 20,
    .help_width = 1000,
    .read_config = read_config,
};

static char help_text[4096];

/* moed_opt_read over the words; its --help or --version output lands in help_text. */
static int read_daemon(daemon_args *a, moed_error *err, int n, const char *const *words)
{
    char *argv[16] = { "d" };
    for (int i = 0; i < n; i++) argv[i + 1] = (char *)words[i];
    free(a->text);
    memset(a, 0, sizeof *a);
    memset(help_text, 0, sizeof help_text);
    FILE *out = fmemopen(help_text, sizeof help_text - 1, "w");
    moed_opt_parsed p;
    int rc = moed_opt_read(&daemon_spec, n + 1, argv, a, &p, out, err);
    fclose(out);
    return rc;
}

#define READ(a, err, ...)                                                                          \
    read_daemon(a, err, sizeof((const char *[]){ __VA_ARGS__ }) / sizeof(const char *),            \
                (const char *[]){ __VA_ARGS__ })

static void expect(int rc, const moed_error *err, const char *says)
{
    CHECK_MSG(rc == MOED_EINVAL && strstr(err->msg, says), "wanted '%s', got %d '%s'", says, rc,
              err->msg);
}

static void test_daemon_values(void)
{
    daemon_args a = { 0 };
    moed_error err;
    CHECK_EQ_INT(READ(&a, &err, "--verbose"), MOED_OPT_RUN);
    CHECK(!strcmp(a.listen, "127.0.0.1:1") && !strcmp(a.mode, "a") && a.threads == 4);
    CHECK(a.bytes == 1024 && a.verbose == 1 && a.level == 0 && !a.file);
    CHECK_EQ_INT(READ(&a, &err, "--bytes", "2 MiB", "--verbose=0", "--mode=b", "--file", "",
                      "--level", "high", "--threads", "+8"),
                 MOED_OPT_RUN);
    CHECK(a.bytes == 2 << 20 && !a.verbose && !strcmp(a.mode, "b") && !strcmp(a.file, ""));
    CHECK(a.level == 1 && a.threads == 8);

    expect(READ(&a, &err, "--thread", "1"), &err, "unknown option --thread"); /* no prefixes */
    expect(READ(&a, &err, "-x"), &err, "unknown option -x");
    expect(READ(&a, &err, "stray"), &err, "unexpected argument 'stray'; options start with --");
    expect(READ(&a, &err, "--threads"), &err, "--threads needs a value: N");
    expect(READ(&a, &err, "--threads", " 8"), &err,
           "--threads: ' 8' is not an integer; give an integer in [0, 64]");
    expect(READ(&a, &err, "--threads", "65"), &err,
           "--threads: 65 is out of range; give a value in [0, 64]");
    expect(READ(&a, &err, "--bytes", "2GiB"), &err, "--bytes: 2147483648 is out of range");
    expect(READ(&a, &err, "--bytes", "12XB"), &err, "--bytes: '12XB' is not a byte count");
    expect(READ(&a, &err, "--verbose=2"), &err, "--verbose: 2 is out of range");
    expect(READ(&a, &err, "--mode", "ab"), &err, "--mode: 'ab' is not one of a|b");
    expect(READ(&a, &err, "--listen="), &err, "--listen: empty value; give a ADDR");
    expect(READ(&a, &err, "--level", "loud"), &err, "--level: 'loud' is too loud");
    expect(READ(&a, &err, "--level", "mid"), &err,
           "--level: 'mid' is not an integer"); /* a custom with no want: the kind's words */
    /* every word is checked before any value: the unknown one is the error */
    expect(READ(&a, &err, "--threads", "x", "--nope"), &err, "unknown option --nope");
    free(a.text);
}

static void test_daemon_file(void)
{
    daemon_args a = { 0 };
    moed_error err;
    config_text = "# a comment\n\n  threads = 7   # seven\nlisten = \"h # 1\"\nverbose = 1\n";
    /* the file over the defaults, the command line over the file, wherever --config stands */
    CHECK_EQ_INT(READ(&a, &err, "--threads", "9", "--config", "d.conf"), MOED_OPT_RUN);
    CHECK(a.threads == 9 && a.verbose == 1 && !strcmp(a.listen, "h # 1") && a.bytes == 1024);
    CHECK(!strcmp(a.config, "d.conf"));
    config_text = "threads = 3\nbogus = 1\n";
    expect(READ(&a, &err, "--config", "d.conf"), &err,
           "d.conf:2: unknown key 'bogus'; keys are the long flags' names (see d --help)");
    config_text = "thread = 3\n";
    expect(READ(&a, &err, "--config", "d.conf"), &err, "d.conf:1: unknown key 'thread'");
    config_text = "help = 1\n";
    expect(READ(&a, &err, "--config", "d.conf"), &err, "d.conf:1: unknown key 'help'");
    config_text = "threads = many\n";
    expect(READ(&a, &err, "--config", "d.conf"), &err, "d.conf:1: 'many' is not an integer");
    config_text = "just words\n";
    expect(READ(&a, &err, "--config", "d.conf"), &err, "d.conf:1: expected `key = value`");
    config_text = "listen = \"a\" b\n";
    expect(READ(&a, &err, "--config", "d.conf"), &err, "d.conf:1: text after the closing quote");
    expect(READ(&a, &err, "--config", "other.conf"), &err, "--config: no file other.conf");
    expect(READ(&a, &err, "--config="), &err, "--config: empty value; give a FILE");
    free(a.text);
}

static void test_daemon_answers(void)
{
    daemon_args a = { 0 };
    moed_error err;
    /* --help and -V answer before any value (or the config file) is looked at */
    CHECK_EQ_INT(READ(&a, &err, "--threads", "x", "--config", "missing", "-h"), MOED_OPT_DONE);
    CHECK_MSG(!strcmp(help_text, "usage: d\n"
                                 "  --listen ADDR     where (default 127.0.0.1:1)\n"
                                 "  --mode a|b        a mode (default a)\n"
                                 "  --threads N       threads (default 4)\n"
                                 "  --bytes BYTES     bytes (default 1024)\n"
                                 "  --verbose         say more (default off)\n"
                                 "  --file F          a file, or empty\n"
                                 "  --level low|high  a level (default low)\n"
                                 "  --config FILE     c\n"
                                 "  --help            this text\n"
                                 "  --version         the version\n"
                                 "\n"
                                 "end\n"),
              "%s", help_text);
    CHECK_EQ_INT(READ(&a, &err, "-V"), MOED_OPT_DONE);
    CHECK(!strcmp(help_text, "d 1.0\n"));
    expect(READ(&a, &err, "--help=1"), &err, "--help takes no value");
    expect(READ(&a, &err, "-h", "--nope"), &err, "unknown option --nope");
}

int main(void)
{
    test_values_and_defaults();
    test_usage_errors();
    test_help();
    test_daemon_values();
    test_daemon_file();
    test_daemon_answers();
    return check_status("test_opt");
}
