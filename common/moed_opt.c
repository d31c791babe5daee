/*
 * moed_opt — the option table's parser and help printer (moed_opt.h states the contract).
 */
#include "moed_opt.h"

#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

enum { HELP_COLUMN = 24, HELP_WIDTH = 100 }; /* where an option's help starts and ends */

int moed_opt_usage(const moed_opt_spec *spec, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "%s: ", spec->prog);
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n(%s)\n", spec->hint);
    va_end(ap);
    return MOED_OPT_EXIT_USAGE;
}

/* ---- values ---- */

static int parse_int(const char *s, double lo, double hi, long long *out)
{
    char *end;
    long long v = strtoll(s, &end, 10);
    if (!*s || *end || v < (long long)lo || v > (long long)hi) return -1;
    *out = v;
    return 0;
}

static int parse_num(const char *s, double lo, double hi, double *out)
{
    char *end;
    double v = strtod(s, &end);
    if (!*s || *end || !isfinite(v) || v < lo || v > hi) return -1;
    *out = v;
    return 0;
}

/* Stores value into the row's field of dst; -1 when the value is not one the row takes. */
static int store(const moed_opt *o, const char *value, void *dst)
{
    void *field = (char *)dst + o->field;
    switch (o->kind) {
    case MOED_OPT_FLAG:
        *(int *)field = o->set;
        return 0;
    case MOED_OPT_STR:
        *(const char **)field = value;
        return 0;
    case MOED_OPT_I64:
        return parse_int(value, o->lo, o->hi, field);
    case MOED_OPT_NUM:
        return parse_num(value, o->lo, o->hi, field);
    case MOED_OPT_CUSTOM:
        return o->parse(value, field);
    case MOED_OPT_SECTION:
    case MOED_OPT_HELP:
        break;
    }
    return 0;
}

/* A default that does not parse is a bug in the table, not the user's: say so loudly. */
static void store_defaults(const moed_opt_spec *spec, void *dst)
{
    for (size_t i = 0; i < spec->n_opts; i++) {
        const moed_opt *o = &spec->opts[i];
        if (o->def && store(o, o->def, dst)) {
            fprintf(stderr, "%s: the default of --%s, '%s', is not valid\n", spec->prog, o->name,
                    o->def);
            abort();
        }
    }
}

/* ---- words ---- */

/* The option whose name is name[0..len): exact, or else the only one it is a prefix of. */
static const moed_opt *find_opt(const moed_opt_spec *spec, const char *name, size_t len,
                                int *matches)
{
    const moed_opt *hit = NULL;
    *matches = 0;
    for (size_t i = 0; i < spec->n_opts; i++) {
        const moed_opt *o = &spec->opts[i];
        if (o->kind == MOED_OPT_SECTION || strncmp(o->name, name, len)) continue;
        if (!o->name[len]) {
            *matches = 1;
            return o;
        }
        hit = o;
        ++*matches;
    }
    return *matches == 1 ? hit : NULL;
}

static const moed_opt_cmd *find_cmd(const moed_opt_spec *spec, const char *name)
{
    if (!name) return &spec->cmds[0];
    for (size_t i = 1; i < spec->n_cmds; i++)
        if (!strcmp(spec->cmds[i].name, name)) return &spec->cmds[i];
    return NULL;
}

/* The option word argv[*i] ("--name" or "--name=value"), and its value from the next word if it
 * takes one; 0, or the exit code after a usage error. */
static int take_option(const moed_opt_spec *spec, int argc, char **argv, int *i, void *dst,
                       moed_opt_parsed *out)
{
    const char *word = argv[*i], *name = word + 2;
    const char *eq = strchr(name, '=');
    size_t len = eq ? (size_t)(eq - name) : strlen(name);
    int matches = 0;
    const moed_opt *o = word[1] == '-' && len ? find_opt(spec, name, len, &matches) : NULL;
    if (!o)
        return moed_opt_usage(spec, "%s option %.*s", matches > 1 ? "ambiguous" : "unknown",
                              (int)(eq ? eq - word : (long)strlen(word)), word);
    const char *value = eq ? eq + 1 : NULL;
    if (o->kind == MOED_OPT_FLAG || o->kind == MOED_OPT_HELP) {
        if (value) return moed_opt_usage(spec, "--%s takes no value", o->name);
    } else if (!value) {
        if (*i + 1 >= argc) return moed_opt_usage(spec, "--%s needs a value", o->name);
        value = argv[++*i];
    }
    if (store(o, value, dst)) return moed_opt_usage(spec, "--%s %s: %s", o->name, value, o->want);
    out->seen[o - spec->opts] = true;
    return 0;
}

/* After the words: the command is known, --help answered, every option given belongs to it. */
static int check_command(const moed_opt_spec *spec, const moed_opt_parsed *out, bool *help)
{
    if (!find_cmd(spec, out->command))
        return moed_opt_usage(spec, "unknown command '%s'", out->command);
    for (size_t i = 0; i < spec->n_opts; i++)
        if (out->seen[i] && spec->opts[i].kind == MOED_OPT_HELP) *help = true;
    if (*help || (spec->n_cmds > 1 && !out->command)) return 0;
    for (size_t i = 0; i < spec->n_opts; i++) {
        const moed_opt *o = &spec->opts[i];
        if (out->seen[i] && o->cmd && strcmp(o->cmd, out->command))
            return moed_opt_usage(spec, "--%s belongs to '%s', not '%s'", o->name, o->cmd,
                                  out->command);
    }
    return 0;
}

bool moed_opt_parse(const moed_opt_spec *spec, int argc, char **argv, void *dst,
                    moed_opt_parsed *out, int *exit_code)
{
    memset(out, 0, sizeof *out);
    if (spec->n_opts > MOED_OPT_MAX) {
        fprintf(stderr, "%s: %zu options, over MOED_OPT_MAX\n", spec->prog, spec->n_opts);
        abort();
    }
    store_defaults(spec, dst);
    bool words_only = false, help = false;
    int rc = 0;
    for (int i = 1; i < argc && !rc; i++) {
        const char *w = argv[i];
        if (!words_only && !strcmp(w, "--"))
            words_only = true;
        else if (!words_only && w[0] == '-' && w[1])
            rc = take_option(spec, argc, argv, &i, dst, out);
        else if (spec->n_cmds > 1 && !out->command)
            out->command = w;
        else
            rc = moed_opt_usage(spec, "unexpected argument '%s'", w);
    }
    if (!rc) rc = check_command(spec, out, &help);
    *exit_code = rc;
    if (rc) return false;
    if (help) {
        moed_opt_help(spec, out->command, stdout);
        return false;
    }
    if (spec->n_cmds > 1 && !out->command) { /* a tool with commands was given none */
        moed_opt_help(spec, NULL, stderr);
        *exit_code = MOED_OPT_EXIT_USAGE;
        return false;
    }
    return true;
}

bool moed_opt_given(const moed_opt_spec *spec, const moed_opt_parsed *p, const char *name)
{
    for (size_t i = 0; i < spec->n_opts; i++)
        if (spec->opts[i].kind != MOED_OPT_SECTION && !strcmp(spec->opts[i].name, name))
            return p->seen[i];
    return false;
}

/* ---- help ---- */

static void print_row(const moed_opt *o, FILE *f)
{
    if (o->kind == MOED_OPT_SECTION) {
        fprintf(f, "\n%s\n", o->name);
        return;
    }
    int col = fprintf(f, "  --%s%s%s", o->name, o->arg ? " " : "", o->arg ? o->arg : "");
    if (col > HELP_COLUMN - 2) {
        fputc('\n', f);
        col = 0;
    }
    const char *h = o->help ? o->help : "";
    for (const char *nl; (nl = strchr(h, '\n')); h = nl + 1, col = 0)
        fprintf(f, "%*s%.*s\n", HELP_COLUMN - col, "", (int)(nl - h), h);
    col += fprintf(f, "%*s%s", HELP_COLUMN - col, "", h);
    if (o->def && col + strlen(o->def) + 11 > HELP_WIDTH) { /* " (default " ")" */
        fprintf(f, "\n%*s", HELP_COLUMN, "");
        col = HELP_COLUMN;
    }
    if (o->def) fprintf(f, "%s(default %s)", col > HELP_COLUMN ? " " : "", o->def);
    fputc('\n', f);
}

void moed_opt_help(const moed_opt_spec *spec, const char *command, FILE *f)
{
    const moed_opt_cmd *cmd = find_cmd(spec, command);
    fputs(cmd->head, f);
    for (size_t i = 0; i < spec->n_opts; i++) {
        const moed_opt *o = &spec->opts[i];
        if (o->cmd ? command && !strcmp(o->cmd, command) : !command) print_row(o, f);
    }
    if (cmd->tail) fprintf(f, "\n%s", cmd->tail);
}
