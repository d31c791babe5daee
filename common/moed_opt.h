/*
 * moed_opt — the one option engine of every program (moed, moectl, moed-load, the benchmarks): a
 * table whose rows each hold an option's name, kind of value, bounds, default and help. The same
 * table parses the command line (and the daemon's config file) into the program's struct and
 * prints its --help, so they cannot disagree. Each program keeps only its table.
 *
 * Contract:
 * - "--name VALUE" or "--name=VALUE", anywhere on the line; a VALUE is the next word even when it
 *   starts with '-'. A unique prefix of a name stands for it (as getopt_long allowed) unless the
 *   spec asks for exact names. A row may have a one-letter form ("-h"). After "--" every word is
 *   positional; a program with commands takes the first positional word as its command, and any
 *   other is an error.
 * - The words are read first, left to right: the first that names no option of the table, lacks
 *   its value or gives a value to a flag is the usage error. Then the command is checked (known,
 *   and every option given belongs to it), then --help or --version is answered, before any value
 *   is looked at. Then values are stored, each checked as it is: the rows' defaults (a default
 *   that does not parse is a bug of the table: abort), the config file's lines where the table has
 *   a MOED_OPT_CONFIG row and the line names one, then the command line's values in order, so the
 *   command line wins over the file and the file over the defaults.
 * - A bad value is a usage error naming where it came from ("--flag", or "FILE:LINE"), the value
 *   and what is accepted: the row's `want` when it has one ("--count 11: give 1 to 10"), else what
 *   its kind and bounds take ("--threads: 'x' is not an integer; give an integer in [0, 4096]").
 * - The config file: lines of `name = value` with the long options' names; blank lines and
 *   `# comment` lines; a `#` after an unquoted value starts a comment. A value in double quotes is
 *   taken as it is up to its closing quote, `#` and blanks included; inside quotes \" is a quote
 *   and \\ a backslash (no other escapes), and only a comment may follow. Its names are exact, and
 *   --help, --version and --config are not among them. The spec's read_config reads the file (and
 *   keeps its text, which string values point into, for as long as dst lives).
 * - String values point into argv, the config text or the table's defaults: nothing to free.
 * - moed_opt_parse prints usage errors as "PROG: MESSAGE" and the spec's hint on stderr and means
 *   exit status 2 (MOED_OPT_EXIT_USAGE); --help and --version print on stdout and mean 0.
 */
#ifndef MOED_OPT_H
#define MOED_OPT_H

#include "moed_err.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

enum {
    MOED_OPT_EXIT_USAGE = 2,
    MOED_OPT_MAX = 64,         /* rows in a table */
    MOED_OPT_HELP_COLUMN = 24, /* where an option's help starts, unless the spec says */
    MOED_OPT_HELP_WIDTH = 100, /* where a help line wraps its default, unless the spec says */
};

typedef enum moed_opt_kind {
    MOED_OPT_SECTION, /* not an option: a heading in --help (the row's name) */
    MOED_OPT_HELP,    /* --help: the help of the command given, on stdout */
    MOED_OPT_VERSION, /* --version: the spec's version line, on stdout */
    MOED_OPT_CONFIG,  /* --config FILE (const char *, not empty): the config file, read first */
    MOED_OPT_FLAG,    /* no value: stores `set` in an int */
    MOED_OPT_SWITCH,  /* int 0|1: the bare option is 1, or "--name=0|1" ("name = 0|1" in a file);
                         its default shows as on|off */
    MOED_OPT_STR,     /* const char *: the word itself; with lo = 1, not an empty one */
    MOED_OPT_CHOICE,  /* const char *: one of the '|'-separated words of arg */
    MOED_OPT_INT,     /* int: a decimal integer in [lo, hi] */
    MOED_OPT_I64,     /* int64_t: a decimal integer in [lo, hi] */
    MOED_OPT_BYTES,   /* int64_t: an integer in [lo, hi], with an optional KiB/MiB/GiB suffix */
    MOED_OPT_NUM,     /* double: a finite number in [lo, hi] */
    MOED_OPT_CUSTOM,  /* parse(value, field, err) */
} moed_opt_kind;

typedef struct moed_opt {
    const char *name; /* without the dashes */
    moed_opt_kind kind;
    size_t field;     /* offsetof the value in the program's struct */
    const char *arg;  /* the value's name in --help ("S", "ADDR"); CHOICE: the words */
    double lo, hi;    /* INT, I64, BYTES, NUM: inclusive bounds; STR: lo = 1, not empty */
    const char *def;  /* the default as it would be typed; NULL: none */
    const char *want; /* what a bad value is told ("give seconds > 0"); NULL: the kind says */
    const char *help; /* lines separated by '\n'; " (default DEF)" is added */
    const char *cmd;  /* the command it belongs to; NULL: any */
    int set;          /* FLAG: the value stored */
    char letter;      /* the one-letter form ('h' for -h); 0: none */
    /* CUSTOM: stores value into field; nonzero for a bad one, with err saying why (the engine
     * puts where it came from in front) or, err left clear, for the row's `want` to say it. */
    int (*parse)(const char *value, void *field, moed_error *err);
} moed_opt;

/* Rows, one line each in a table (FIELD: offsetof the value in the program's struct; CMD: the
 * command the option belongs to, NULL for any; WANT: NULL for the kind's own words). */
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
#define MOED_OPT_SWITCH_ROW(NAME, FIELD, DEF, CMD, HELP)                                           \
    {                                                                                              \
        .name = NAME, .kind = MOED_OPT_SWITCH, .field = FIELD, .lo = 0, .hi = 1, .def = DEF,       \
        .cmd = CMD, .help = HELP                                                                   \
    }
#define MOED_OPT_STR_ROW(NAME, FIELD, ARG, DEF, CMD, HELP)                                         \
    {                                                                                              \
        .name = NAME, .kind = MOED_OPT_STR, .field = FIELD, .arg = ARG, .def = DEF, .cmd = CMD,    \
        .help = HELP                                                                               \
    }
/* A STR row that refuses an empty word (a path, a spec). */
#define MOED_OPT_WORD_ROW(NAME, FIELD, ARG, DEF, CMD, HELP)                                        \
    {                                                                                              \
        .name = NAME, .kind = MOED_OPT_STR, .field = FIELD, .arg = ARG, .lo = 1, .def = DEF,       \
        .cmd = CMD, .help = HELP                                                                   \
    }
#define MOED_OPT_CHOICE_ROW(NAME, FIELD, WORDS, DEF, CMD, HELP)                                    \
    {                                                                                              \
        .name = NAME, .kind = MOED_OPT_CHOICE, .field = FIELD, .arg = WORDS, .def = DEF,           \
        .cmd = CMD, .help = HELP                                                                   \
    }
#define MOED_OPT_INT_ROW(NAME, FIELD, ARG, LO, HI, DEF, WANT, CMD, HELP)                           \
    {                                                                                              \
        .name = NAME, .kind = MOED_OPT_INT, .field = FIELD, .arg = ARG, .lo = LO, .hi = HI,        \
        .def = DEF, .want = WANT, .cmd = CMD, .help = HELP                                         \
    }
#define MOED_OPT_I64_ROW(NAME, FIELD, ARG, LO, HI, DEF, WANT, CMD, HELP)                           \
    {                                                                                              \
        .name = NAME, .kind = MOED_OPT_I64, .field = FIELD, .arg = ARG, .lo = LO, .hi = HI,        \
        .def = DEF, .want = WANT, .cmd = CMD, .help = HELP                                         \
    }
#define MOED_OPT_BYTES_ROW(NAME, FIELD, ARG, LO, HI, DEF, WANT, CMD, HELP)                         \
    {                                                                                              \
        .name = NAME, .kind = MOED_OPT_BYTES, .field = FIELD, .arg = ARG, .lo = LO, .hi = HI,      \
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

/* A program (name NULL) or one of its commands, and the text around its options in --help. */
typedef struct moed_opt_cmd {
    const char *name;
    const char *head; /* the usage line and what it does */
    const char *tail; /* after the options (exit codes); may be NULL */
} moed_opt_cmd;

typedef struct moed_opt_spec {
    const char *prog;
    const char *hint;    /* after a usage error: where to read more */
    const char *version; /* what --version prints (a VERSION row) */
    const moed_opt *opts;
    size_t n_opts;            /* at most MOED_OPT_MAX */
    const moed_opt_cmd *cmds; /* [0]: the program itself; then its commands, if any */
    size_t n_cmds;
    bool exact;                  /* names only in full: no prefixes */
    int help_column, help_width; /* 0: MOED_OPT_HELP_COLUMN, MOED_OPT_HELP_WIDTH */
    /* A CONFIG row's file, read into *text (len bytes; the engine writes into it), kept by the
     * program as long as dst lives; a negative code with err for a file it cannot use. */
    int (*read_config)(void *dst, const char *path, char **text, size_t *len, moed_error *err);
} moed_opt_spec;

/* The spec of a program without commands: PROG (a string literal), its option table OPTS (an
 * array) and its moed_opt_cmd TOOL; a usage error points at PROG --help. */
#define MOED_OPT_TOOL_SPEC(PROG, OPTS, TOOL)                                                       \
    {                                                                                              \
        .prog = PROG, .hint = PROG " --help lists the options", .opts = OPTS,                      \
        .n_opts = sizeof OPTS / sizeof OPTS[0], .cmds = &TOOL, .n_cmds = 1                         \
    }

typedef struct moed_opt_parsed {
    const char *command;     /* the command given; NULL for a program without commands */
    bool seen[MOED_OPT_MAX]; /* per row: given on the command line */
} moed_opt_parsed;

/* What moed_opt_read found: go on, or --help or --version answered. */
enum { MOED_OPT_RUN = 0, MOED_OPT_DONE = 1 };

/* Reads argv (and the config file) into dst: MOED_OPT_RUN, MOED_OPT_DONE after printing --help or
 * --version to out, or MOED_EINVAL with err saying why (a usage error; nothing printed). */
int moed_opt_read(const moed_opt_spec *spec, int argc, char **argv, void *dst, moed_opt_parsed *out,
                  FILE *help_out, moed_error *err);

/* moed_opt_read as a command-line tool wants it: true when the program should go on; false when
 * it should exit with *exit_code (0 after --help or --version, MOED_OPT_EXIT_USAGE after a usage
 * error, both already printed). */
bool moed_opt_parse(const moed_opt_spec *spec, int argc, char **argv, void *dst,
                    moed_opt_parsed *out, int *exit_code);

/* A decimal integer at s (an optional sign, then digits, within int64_t) into *v, what follows it
 * left in *end; -1 for none. For a program's own syntaxes of values (lists of numbers). */
int moed_opt_integer(const char *s, int64_t *v, char **end);

/* Whether the option called name was on the command line. */
bool moed_opt_given(const moed_opt_spec *spec, const moed_opt_parsed *p, const char *name);

/* Prints "PROG: MESSAGE" and the hint on stderr; returns MOED_OPT_EXIT_USAGE. */
int moed_opt_usage(const moed_opt_spec *spec, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* Writes the help of command (NULL: the program's own) to f. */
void moed_opt_help(const moed_opt_spec *spec, const char *command, FILE *f);

#endif
