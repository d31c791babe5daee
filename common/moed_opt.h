/*
 * moed_opt — the one option parser of the command-line tools (moectl, moed-load): a table whose
 * rows each hold an option's name, kind of value, bounds, default and help. The same table parses
 * argv into the tool's struct and prints its --help, so the two cannot disagree.
 *
 * Contract:
 * - "--name VALUE" or "--name=VALUE", anywhere on the line; a unique prefix of a name stands for
 *   it (as getopt_long allowed); a VALUE is the next word even when it starts with '-'. Other words
 *   are positional: a tool with commands takes the first as its command, and any more is an error.
 * - Defaults are parsed exactly like values, before argv; a row without one leaves the struct's
 *   field as the tool set it. A value is checked where it is read (MOED_OPT_I64 and MOED_OPT_NUM
 * against [lo, hi]): a bad one is a usage error naming the flag, the value and the row's `want`.
 * - An option that belongs to another command than the one given is a usage error.
 * - Usage errors print "PROG: MESSAGE" and the spec's hint on stderr and mean exit status 2
 *   (MOED_OPT_EXIT_USAGE); --help prints on stdout and means 0.
 */
#ifndef MOED_OPT_H
#define MOED_OPT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>

enum { MOED_OPT_EXIT_USAGE = 2, MOED_OPT_MAX = 64 };

typedef enum moed_opt_kind {
    MOED_OPT_SECTION, /* not an option: a heading in --help (the row's name) */
    MOED_OPT_HELP,    /* --help: the help of the command given, on stdout */
    MOED_OPT_FLAG,    /* no value: stores `set` in an int */
    MOED_OPT_STR,     /* const char *: the word itself */
    MOED_OPT_I64,     /* long long: a decimal integer in [lo, hi] */
    MOED_OPT_NUM,     /* double: a finite number in [lo, hi] */
    MOED_OPT_CUSTOM,  /* parse(value, field): 0, or -1 for a bad value */
} moed_opt_kind;

typedef struct moed_opt {
    const char *name; /* without the dashes */
    moed_opt_kind kind;
    size_t field;     /* offsetof the value in the tool's struct */
    const char *arg;  /* the value's name in --help ("S", "ADDR") */
    double lo, hi;    /* MOED_OPT_I64, MOED_OPT_NUM: inclusive bounds */
    const char *def;  /* the default as it would be typed; NULL: none */
    const char *want; /* what a bad value is told ("give seconds > 0") */
    const char *help; /* lines separated by '\n'; " (default DEF)" is added */
    const char *cmd;  /* the command it belongs to; NULL: any */
    int set;          /* MOED_OPT_FLAG: the value stored */
    int (*parse)(const char *value, void *field); /* MOED_OPT_CUSTOM */
} moed_opt;

/* Rows, one line each in a table (FIELD: offsetof the value in the tool's struct; CMD: the
 * command the option belongs to, NULL for any). */
#define MOED_OPT_SECTION_ROW(TITLE, CMD)                                                           \
    {                                                                                              \
        .name = TITLE, .kind = MOED_OPT_SECTION, .cmd = CMD                                        \
    }
#define MOED_OPT_HELP_ROW(HELP)                                                                    \
    {                                                                                              \
        .name = "help", .kind = MOED_OPT_HELP, .help = HELP                                        \
    }
#define MOED_OPT_FLAG_ROW(NAME, FIELD, SET, CMD, HELP)                                             \
    {                                                                                              \
        .name = NAME, .kind = MOED_OPT_FLAG, .field = FIELD, .set = SET, .cmd = CMD, .help = HELP  \
    }
#define MOED_OPT_STR_ROW(NAME, FIELD, ARG, DEF, CMD, HELP)                                         \
    {                                                                                              \
        .name = NAME, .kind = MOED_OPT_STR, .field = FIELD, .arg = ARG, .def = DEF, .cmd = CMD,    \
        .help = HELP                                                                               \
    }
#define MOED_OPT_I64_ROW(NAME, FIELD, ARG, LO, HI, DEF, WANT, CMD, HELP)                           \
    {                                                                                              \
        .name = NAME, .kind = MOED_OPT_I64, .field = FIELD, .arg = ARG, .lo = LO, .hi = HI,        \
        .def = DEF, .want = WANT, .cmd = CMD, .help = HELP                                         \
    }
#define MOED_OPT_NUM_ROW(NAME, FIELD, ARG, LO, HI, DEF, WANT, CMD, HELP)                           \
    {                                                                                              \
        .name = NAME, .kind = MOED_OPT_NUM, .field = FIELD, .arg = ARG, .lo = LO, .hi = HI,        \
        .def = DEF, .want = WANT, .cmd = CMD, .help = HELP                                         \
    }
#define MOED_OPT_CUSTOM_ROW(NAME, FIELD, ARG, PARSE, DEF, WANT, CMD, HELP)                         \
    {                                                                                              \
        .name = NAME, .kind = MOED_OPT_CUSTOM, .field = FIELD, .arg = ARG, .parse = PARSE,         \
        .def = DEF, .want = WANT, .cmd = CMD, .help = HELP                                         \
    }

/* A tool (name NULL) or one of its commands, and the text around its options in --help. */
typedef struct moed_opt_cmd {
    const char *name;
    const char *head; /* the usage line and what it does */
    const char *tail; /* after the options (exit codes); may be NULL */
} moed_opt_cmd;

typedef struct moed_opt_spec {
    const char *prog;
    const char *hint; /* after a usage error: where to read more */
    const moed_opt *opts;
    size_t n_opts;            /* at most MOED_OPT_MAX */
    const moed_opt_cmd *cmds; /* [0]: the tool itself; then its commands, if any */
    size_t n_cmds;
} moed_opt_spec;

/* The spec of a tool without commands: PROG (a string literal), its option table OPTS (an array)
 * and its moed_opt_cmd TOOL; a usage error points at PROG --help. */
#define MOED_OPT_TOOL_SPEC(PROG, OPTS, TOOL)                                                       \
    {                                                                                              \
        .prog = PROG, .hint = PROG " --help lists the options", .opts = OPTS,                      \
        .n_opts = sizeof OPTS / sizeof OPTS[0], .cmds = &TOOL, .n_cmds = 1                         \
    }

typedef struct moed_opt_parsed {
    const char *command;     /* the command given; NULL for a tool without commands */
    bool seen[MOED_OPT_MAX]; /* per row: given on the command line */
} moed_opt_parsed;

/* Parses argv into dst. Returns true when the tool should go on; false when it should exit with
 * *exit_code (0 after --help, MOED_OPT_EXIT_USAGE after a usage error, both already printed). */
bool moed_opt_parse(const moed_opt_spec *spec, int argc, char **argv, void *dst,
                    moed_opt_parsed *out, int *exit_code);

/* Whether the option called name was on the command line. */
bool moed_opt_given(const moed_opt_spec *spec, const moed_opt_parsed *p, const char *name);

/* Prints "PROG: MESSAGE" and the hint on stderr; returns MOED_OPT_EXIT_USAGE. */
int moed_opt_usage(const moed_opt_spec *spec, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* Writes the help of command (NULL: the tool's own) to f. */
void moed_opt_help(const moed_opt_spec *spec, const char *command, FILE *f);

#endif
