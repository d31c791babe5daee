/*
 * cli_opt — the one option parser of the command-line tools (moectl, moed-load): a table whose
 * rows each hold an option's name, kind of value, bounds, default and help. The same table parses
 * argv into the tool's struct and prints its --help, so the two cannot disagree.
 *
 * Contract:
 * - "--name VALUE" or "--name=VALUE", anywhere on the line; a unique prefix of a name stands for
 *   it (as getopt_long allowed); a VALUE is the next word even when it starts with '-'. Other words
 *   are positional: a tool with commands takes the first as its command, and any more is an error.
 * - Defaults are parsed exactly like values, before argv; a row without one leaves the struct's
 *   field as the tool set it. A value is checked where it is read (CLI_INT and CLI_NUM against
 *   [lo, hi]): a bad one is a usage error naming the flag, the value and the row's `want`.
 * - An option that belongs to another command than the one given is a usage error.
 * - Usage errors print "PROG: MESSAGE" and the spec's hint on stderr and mean exit status 2
 *   (CLI_EXIT_USAGE); --help prints on stdout and means 0.
 */
#ifndef MOED_CLI_OPT_H
#define MOED_CLI_OPT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>

enum { CLI_EXIT_USAGE = 2, CLI_MAX_OPTS = 64 };

typedef enum cli_kind {
    CLI_SECTION, /* not an option: a heading in --help (the row's name) */
    CLI_HELP,    /* --help: the help of the command given, on stdout */
    CLI_FLAG,    /* no value: stores `set` in an int */
    CLI_STR,     /* const char *: the word itself */
    CLI_INT,     /* long long: a decimal integer in [lo, hi] */
    CLI_NUM,     /* double: a finite number in [lo, hi] */
    CLI_CUSTOM,  /* parse(value, field): 0, or -1 for a bad value */
} cli_kind;

typedef struct cli_opt {
    const char *name; /* without the dashes */
    cli_kind kind;
    size_t field;     /* offsetof the value in the tool's struct */
    const char *arg;  /* the value's name in --help ("S", "ADDR") */
    double lo, hi;    /* CLI_INT, CLI_NUM: inclusive bounds */
    const char *def;  /* the default as it would be typed; NULL: none */
    const char *want; /* what a bad value is told ("give seconds > 0") */
    const char *help; /* lines separated by '\n'; " (default DEF)" is added */
    const char *cmd;  /* the command it belongs to; NULL: any */
    int set;          /* CLI_FLAG: the value stored */
    int (*parse)(const char *value, void *field); /* CLI_CUSTOM */
} cli_opt;

/* Rows, one line each in a table (FIELD: offsetof the value in the tool's struct; CMD: the
 * command the option belongs to, NULL for any). */
#define CLI_SECTION_ROW(TITLE, CMD)                                                                \
    {                                                                                              \
        .name = TITLE, .kind = CLI_SECTION, .cmd = CMD                                             \
    }
#define CLI_HELP_OPT(HELP)                                                                         \
    {                                                                                              \
        .name = "help", .kind = CLI_HELP, .help = HELP                                             \
    }
#define CLI_FLAG_OPT(NAME, FIELD, SET, CMD, HELP)                                                  \
    {                                                                                              \
        .name = NAME, .kind = CLI_FLAG, .field = FIELD, .set = SET, .cmd = CMD, .help = HELP       \
    }
#define CLI_STR_OPT(NAME, FIELD, ARG, DEF, CMD, HELP)                                              \
    {                                                                                              \
        .name = NAME, .kind = CLI_STR, .field = FIELD, .arg = ARG, .def = DEF, .cmd = CMD,         \
        .help = HELP                                                                               \
    }
#define CLI_INT_OPT(NAME, FIELD, ARG, LO, HI, DEF, WANT, CMD, HELP)                                \
    {                                                                                              \
        .name = NAME, .kind = CLI_INT, .field = FIELD, .arg = ARG, .lo = LO, .hi = HI, .def = DEF, \
        .want = WANT, .cmd = CMD, .help = HELP                                                     \
    }
#define CLI_NUM_OPT(NAME, FIELD, ARG, LO, HI, DEF, WANT, CMD, HELP)                                \
    {                                                                                              \
        .name = NAME, .kind = CLI_NUM, .field = FIELD, .arg = ARG, .lo = LO, .hi = HI, .def = DEF, \
        .want = WANT, .cmd = CMD, .help = HELP                                                     \
    }
#define CLI_CUSTOM_OPT(NAME, FIELD, ARG, PARSE, DEF, WANT, CMD, HELP)                              \
    {                                                                                              \
        .name = NAME, .kind = CLI_CUSTOM, .field = FIELD, .arg = ARG, .parse = PARSE, .def = DEF,  \
        .want = WANT, .cmd = CMD, .help = HELP                                                     \
    }

/* A tool (name NULL) or one of its commands, and the text around its options in --help. */
typedef struct cli_cmd {
    const char *name;
    const char *head; /* the usage line and what it does */
    const char *tail; /* after the options (exit codes); may be NULL */
} cli_cmd;

typedef struct cli_spec {
    const char *prog;
    const char *hint; /* after a usage error: where to read more */
    const cli_opt *opts;
    size_t n_opts;       /* at most CLI_MAX_OPTS */
    const cli_cmd *cmds; /* [0]: the tool itself; then its commands, if any */
    size_t n_cmds;
} cli_spec;

/* The spec of a tool without commands: PROG (a string literal), its option table OPTS (an array)
 * and its cli_cmd TOOL; a usage error points at PROG --help. */
#define CLI_TOOL_SPEC(PROG, OPTS, TOOL)                                                            \
    {                                                                                              \
        .prog = PROG, .hint = PROG " --help lists the options", .opts = OPTS,                      \
        .n_opts = sizeof OPTS / sizeof OPTS[0], .cmds = &TOOL, .n_cmds = 1                         \
    }

typedef struct cli_parsed {
    const char *command;     /* the command given; NULL for a tool without commands */
    bool seen[CLI_MAX_OPTS]; /* per row: given on the command line */
} cli_parsed;

/* Parses argv into dst. Returns true when the tool should go on; false when it should exit with
 * *exit_code (0 after --help, CLI_EXIT_USAGE after a usage error, both already printed). */
bool cli_parse(const cli_spec *spec, int argc, char **argv, void *dst, cli_parsed *out,
               int *exit_code);

/* Whether the option called name was on the command line. */
bool cli_given(const cli_spec *spec, const cli_parsed *p, const char *name);

/* Prints "PROG: MESSAGE" and the hint on stderr; returns CLI_EXIT_USAGE. */
int cli_usage_error(const cli_spec *spec, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* Writes the help of command (NULL: the tool's own) to f. */
void cli_help(const cli_spec *spec, const char *command, FILE *f);

#endif
