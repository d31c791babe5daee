/*
 * moed_opt — the option engine: words, values, the config file and --help (moed_opt.h states the
 * contract).
 *
 * The command line is walked twice by one function (next_word): once to check its words and find
 * --help, --version, --config and the command, once to store its values after the defaults and
 * the config file, which is what lets the command line win over the file.
 */
#include "moed_opt.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

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

int moed_opt_integer(const char *s, int64_t *v, char **end)
{
    errno = 0;
    long long x = strtoll(s, end, 10);
    if (*end == s || errno == ERANGE || !isdigit((unsigned char)s[s[0] == '-' || s[0] == '+']))
        return -1;
    *v = x;
    return 0;
}

static int parse_bytes(const char *s, int64_t *v)
{
    static const struct {
        const char *suffix;
        int64_t mult;
    } units[] = { { "", 1 },
                  { "k", 1024 },
                  { "kib", 1024 },
                  { "m", 1 << 20 },
                  { "mib", 1 << 20 },
                  { "g", (int64_t)1 << 30 },
                  { "gib", (int64_t)1 << 30 } };
    char *end;
    if (moed_opt_integer(s, v, &end)) return -1;
    while (*end == ' ') end++;
    for (size_t i = 0; i < sizeof units / sizeof units[0]; i++) {
        if (strcasecmp(end, units[i].suffix)) continue;
        if (*v < 0 || *v > INT64_MAX / units[i].mult) return -1;
        *v *= units[i].mult;
        return 0;
    }
    return -1;
}

/* Whether value is one of the '|'-separated words of choices. */
static bool is_choice(const char *value, const char *choices)
{
    const size_t n = strlen(value);
    for (const char *p = choices; *p;) {
        const char *bar = strchr(p, '|');
        const size_t len = bar ? (size_t)(bar - p) : strlen(p);
        if (n && len == n && !strncmp(p, value, n)) return true;
        p += len + (bar != NULL);
    }
    return false;
}

/* A value the row does not take: its `want`, or what its kind takes. */
static int bad_value(const moed_opt *o, const char *value, const char *where, moed_error *err)
{
    const long long lo = (long long)o->lo, hi = (long long)o->hi;
    if (o->want) return moed_fail(err, MOED_EINVAL, "%s %s: %s", where, value, o->want);
    switch (o->kind) {
    case MOED_OPT_STR:
    case MOED_OPT_CONFIG:
        return moed_fail(err, MOED_EINVAL, "%s: empty value; give a %s", where, o->arg);
    case MOED_OPT_CHOICE:
        return moed_fail(err, MOED_EINVAL, "%s: '%s' is not one of %s", where, value, o->arg);
    case MOED_OPT_NUM:
        return moed_fail(err, MOED_EINVAL, "%s: '%s' is not a number in [%g, %g]", where, value,
                         o->lo, o->hi);
    case MOED_OPT_BYTES:
        return moed_fail(err, MOED_EINVAL,
                         "%s: '%s' is not a byte count (like 268435456 or 256MiB); give an "
                         "integer in [%lld, %lld]",
                         where, value, lo, hi);
    default:
        return moed_fail(err, MOED_EINVAL,
                         "%s: '%s' is not an integer; give an integer in [%lld, %lld]", where,
                         value, lo, hi);
    }
}

static int out_of_range(const moed_opt *o, const char *value, int64_t v, const char *where,
                        moed_error *err)
{
    if (o->want) return bad_value(o, value, where, err);
    return moed_fail(err, MOED_EINVAL, "%s: %lld is out of range; give a value in [%lld, %lld]",
                     where, (long long)v, (long long)o->lo, (long long)o->hi);
}

/* Stores value into the row's field of dst; where says where it came from. */
static int store(const moed_opt *o, const char *value, void *dst, const char *where,
                 moed_error *err)
{
    void *field = (char *)dst + o->field;
    int64_t v;
    char *end;
    switch (o->kind) {
    case MOED_OPT_FLAG:
        *(int *)field = o->set;
        return 0;
    case MOED_OPT_STR:
    case MOED_OPT_CONFIG:
    case MOED_OPT_CHOICE:
        if (o->kind == MOED_OPT_CHOICE ? !is_choice(value, o->arg)
                                       : !*value && (o->kind == MOED_OPT_CONFIG || o->lo >= 1))
            return bad_value(o, value, where, err);
        *(const char **)field = value;
        return 0;
    case MOED_OPT_SWITCH:
    case MOED_OPT_INT:
    case MOED_OPT_I64:
    case MOED_OPT_BYTES:
        if (o->kind == MOED_OPT_BYTES ? parse_bytes(value, &v)
                                      : moed_opt_integer(value, &v, &end) || *end != 0)
            return bad_value(o, value, where, err);
        if ((double)v < o->lo || (double)v > o->hi) return out_of_range(o, value, v, where, err);
        if (o->kind == MOED_OPT_SWITCH || o->kind == MOED_OPT_INT)
            *(int *)field = (int)v;
        else
            *(int64_t *)field = v;
        return 0;
    case MOED_OPT_NUM: {
        double d = strtod(value, &end);
        if (!*value || *end || !isfinite(d) || d < o->lo || d > o->hi)
            return bad_value(o, value, where, err);
        *(double *)field = d;
        return 0;
    }
    case MOED_OPT_CUSTOM:
        memset(err, 0, sizeof *err);
        if (!o->parse(value, field, err)) return 0;
        if (!err->msg[0]) return bad_value(o, value, where, err);
        if (!err->code) err->code = MOED_EINVAL;
        moed_error_prefix(err, "%s", where);
        return err->code;
    case MOED_OPT_SECTION:
    case MOED_OPT_HELP:
    case MOED_OPT_VERSION:
        break;
    }
    return 0;
}

/* A default that does not parse is a bug in the table, not the user's: say so loudly. */
static void store_defaults(const moed_opt_spec *spec, void *dst)
{
    for (size_t i = 0; i < spec->n_opts; i++) {
        const moed_opt *o = &spec->opts[i];
        moed_error err;
        char where[80];
        snprintf(where, sizeof where, "the default of --%s", o->name);
        if (o->def && store(o, o->def, dst, where, &err)) {
            fprintf(stderr, "%s: %s\n", spec->prog, err.msg);
            abort();
        }
    }
}

/* ---- words ---- */

/* The option whose name is name[0..len): exact, or else (unless the spec wants exact names) the
 * only one it is a prefix of. */
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
    if (spec->exact) *matches = 0;
    return *matches == 1 ? hit : NULL;
}

static const moed_opt *find_letter(const moed_opt_spec *spec, char letter)
{
    for (size_t i = 0; letter && i < spec->n_opts; i++)
        if (spec->opts[i].letter == letter) return &spec->opts[i];
    return NULL;
}

static const moed_opt_cmd *find_cmd(const moed_opt_spec *spec, const char *name)
{
    if (!name) return &spec->cmds[0];
    for (size_t i = 1; i < spec->n_cmds; i++)
        if (!strcmp(spec->cmds[i].name, name)) return &spec->cmds[i];
    return NULL;
}

/* One word of argv at *i, and its value from the next word if it takes one (*i moves past what it
 * used): *o the option with *value, or *o NULL and *value a positional word (NULL for the "--"
 * after which every word is one). 0, or MOED_EINVAL with err for a word that is none of these. */
static int next_word(const moed_opt_spec *spec, int argc, char **argv, int *i, bool *words_only,
                     const moed_opt **o, const char **value, moed_error *err)
{
    const char *word = argv[*i];
    *o = NULL;
    *value = word;
    if (*words_only || word[0] != '-' || !word[1]) return 0;
    if (!strcmp(word, "--")) {
        *words_only = true;
        *value = NULL;
        return 0;
    }
    const char *name = word + 2, *eq = word[1] == '-' ? strchr(name, '=') : NULL;
    size_t len = eq ? (size_t)(eq - name) : strlen(name);
    int matches = 0;
    if (word[1] != '-')
        *o = word[2] ? NULL : find_letter(spec, word[1]);
    else if (len)
        *o = find_opt(spec, name, len, &matches);
    if (!*o)
        return moed_fail(err, MOED_EINVAL, "%s option %.*s", matches > 1 ? "ambiguous" : "unknown",
                         (int)(eq ? eq - word : (long)strlen(word)), word);
    *value = eq ? eq + 1 : NULL;
    switch ((*o)->kind) {
    case MOED_OPT_FLAG:
    case MOED_OPT_HELP:
    case MOED_OPT_VERSION:
        if (*value) return moed_fail(err, MOED_EINVAL, "--%s takes no value", (*o)->name);
        return 0;
    case MOED_OPT_SWITCH:
        if (!*value) *value = "1";
        return 0;
    default:
        if (*value) return 0;
        if (*i + 1 >= argc)
            return (*o)->arg ? moed_fail(err, MOED_EINVAL, "--%s needs a value: %s", (*o)->name,
                                         (*o)->arg)
                             : moed_fail(err, MOED_EINVAL, "--%s needs a value", (*o)->name);
        *value = argv[++*i];
        return 0;
    }
}

/* The first walk: every word is an option with its value or a positional word in its place, the
 * command is known and every option given belongs to it. *answer: the first --help or --version
 * given; *config: the last --config's row and value. */
static int check_words(const moed_opt_spec *spec, int argc, char **argv, moed_opt_parsed *out,
                       const moed_opt **answer, const moed_opt **config_row, const char **config,
                       moed_error *err)
{
    bool words_only = false;
    *answer = *config_row = NULL;
    *config = NULL;
    for (int i = 1; i < argc; i++) {
        const moed_opt *o;
        const char *value;
        int rc = next_word(spec, argc, argv, &i, &words_only, &o, &value, err);
        if (rc) return rc;
        if (o) {
            out->seen[o - spec->opts] = true;
            if ((o->kind == MOED_OPT_HELP || o->kind == MOED_OPT_VERSION) && !*answer) *answer = o;
            if (o->kind == MOED_OPT_CONFIG) {
                *config_row = o;
                *config = value;
            }
        } else if (value && spec->n_cmds > 1 && !out->command) {
            out->command = value;
        } else if (value) {
            return moed_fail(err, MOED_EINVAL, "unexpected argument '%s'%s", value,
                             spec->n_cmds > 1 ? "" : "; options start with --");
        }
    }
    if (!find_cmd(spec, out->command))
        return moed_fail(err, MOED_EINVAL, "unknown command '%s'", out->command);
    if (*answer || !out->command) return 0;
    for (size_t i = 0; i < spec->n_opts; i++) {
        const moed_opt *o = &spec->opts[i];
        if (out->seen[i] && o->cmd && strcmp(o->cmd, out->command))
            return moed_fail(err, MOED_EINVAL, "--%s belongs to '%s', not '%s'", o->name, o->cmd,
                             out->command);
    }
    return 0;
}

/* The second walk: the command line's values, in order (--config's was read already). */
static int store_words(const moed_opt_spec *spec, int argc, char **argv, void *dst, moed_error *err)
{
    bool words_only = false;
    for (int i = 1; i < argc; i++) {
        const moed_opt *o;
        const char *value;
        char where[80];
        next_word(spec, argc, argv, &i, &words_only, &o, &value, err);
        if (!o || o->kind == MOED_OPT_CONFIG) continue;
        snprintf(where, sizeof where, "--%s", o->name);
        int rc = store(o, value, dst, where, err);
        if (rc) return rc;
    }
    return 0;
}

/* ---- the config file ---- */

static void trim(char **s, char **e)
{
    while (*s < *e && isspace((unsigned char)**s)) (*s)++;
    while (*e > *s && isspace((unsigned char)(*e)[-1])) (*e)--;
}

/* The value after `=`, in place: a double-quoted value keeps everything up to its closing quote
 * (a `#` too), with \" and \\ as the only escapes; an unquoted one ends at a `#` (a comment).
 * After a closing quote only blanks and a comment may follow. */
static int line_value(char *v, char *end, const char *where, char **out, moed_error *err)
{
    while (v < end && isspace((unsigned char)*v)) v++;
    if (v == end || *v != '"') {
        char *hash = memchr(v, '#', (size_t)(end - v));
        if (hash) end = hash;
        trim(&v, &end);
        *end = 0;
        *out = v;
        return 0;
    }
    char *w = v, *r = v + 1;
    for (; r < end && *r != '"'; r++) {
        if (*r == '\\') {
            if (r + 1 == end || (r[1] != '"' && r[1] != '\\'))
                return moed_fail(err, MOED_EINVAL,
                                 "%s: unknown escape in a quoted value; inside double quotes only "
                                 "\\\" (a quote) and \\\\ (a backslash) are escapes",
                                 where);
            r++;
        }
        *w++ = *r;
    }
    if (r == end)
        return moed_fail(err, MOED_EINVAL, "%s: the quoted value has no closing quote", where);
    for (char *t = r + 1; t < end && *t != '#'; t++)
        if (!isspace((unsigned char)*t))
            return moed_fail(err, MOED_EINVAL,
                             "%s: text after the closing quote; only a # comment may follow",
                             where);
    *w = 0;
    *out = v;
    return 0;
}

/* One `key = value` line (end: its end, without the newline). */
static int store_line(const moed_opt_spec *spec, char *line, char *end, void *dst,
                      const char *where, moed_error *err)
{
    trim(&line, &end);
    if (line == end || *line == '#') return 0;
    size_t key_len = strcspn(line, "=#");
    char *eq = line + key_len;
    if (eq >= end || *eq != '=')
        return moed_fail(err, MOED_EINVAL, "%s: expected `key = value`, got '%.*s'", where,
                         (int)(end - line), line);
    char *key = line, *key_end = eq, *val = NULL;
    trim(&key, &key_end);
    int rc = line_value(eq + 1, end, where, &val, err), matches;
    if (rc) return rc;
    const moed_opt *o = find_opt(spec, key, (size_t)(key_end - key), &matches);
    if (!o || matches != 1 || strlen(o->name) != (size_t)(key_end - key) ||
        o->kind == MOED_OPT_CONFIG || o->kind == MOED_OPT_HELP || o->kind == MOED_OPT_VERSION)
        return moed_fail(err, MOED_EINVAL,
                         "%s: unknown key '%.*s'; keys are the long flags' names (see %s --help)",
                         where, (int)(key_end - key), key, spec->prog);
    return store(o, val, dst, where, err);
}

static int store_file(const moed_opt_spec *spec, const moed_opt *row, const char *path, void *dst,
                      moed_error *err)
{
    char *text, where[600];
    size_t len;
    int rc = store(row, path, dst, "--config", err);
    if (!rc) rc = spec->read_config(dst, path, &text, &len, err);
    if (rc) return rc;
    char *line = text, *nl;
    for (int no = 1; !rc && line < text + len; no++, line = nl + 1) {
        snprintf(where, sizeof where, "%s:%d", path, no);
        if (!(nl = memchr(line, '\n', (size_t)(text + len - line)))) nl = text + len;
        if (memchr(line, 0, (size_t)(nl - line)))
            rc = moed_fail(err, MOED_EINVAL, "%s: a NUL byte: not a text file", where);
        else
            rc = store_line(spec, line, nl, dst, where, err);
    }
    return rc;
}

int moed_opt_read(const moed_opt_spec *spec, int argc, char **argv, void *dst, moed_opt_parsed *out,
                  FILE *help_out, moed_error *err)
{
    memset(out, 0, sizeof *out);
    memset(err, 0, sizeof *err);
    if (spec->n_opts > MOED_OPT_MAX) {
        fprintf(stderr, "%s: %zu options, over MOED_OPT_MAX\n", spec->prog, spec->n_opts);
        abort();
    }
    const moed_opt *answer, *config_row;
    const char *config;
    int rc = check_words(spec, argc, argv, out, &answer, &config_row, &config, err);
    if (rc) return rc;
    if (answer && answer->kind == MOED_OPT_VERSION) {
        fprintf(help_out, "%s\n", spec->version);
        return MOED_OPT_DONE;
    }
    if (answer) {
        moed_opt_help(spec, out->command, help_out);
        return MOED_OPT_DONE;
    }
    store_defaults(spec, dst);
    if (config_row && (rc = store_file(spec, config_row, config, dst, err))) return rc;
    return store_words(spec, argc, argv, dst, err);
}

bool moed_opt_parse(const moed_opt_spec *spec, int argc, char **argv, void *dst,
                    moed_opt_parsed *out, int *exit_code)
{
    moed_error err;
    int rc = moed_opt_read(spec, argc, argv, dst, out, stdout, &err);
    *exit_code = rc < 0 ? moed_opt_usage(spec, "%s", err.msg) : 0;
    if (rc) return false;
    if (spec->n_cmds > 1 && !out->command) { /* a program with commands was given none */
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

static const char *shown_default(const moed_opt *o)
{
    if (o->kind == MOED_OPT_SWITCH && o->def) return strcmp(o->def, "0") ? "on" : "off";
    return o->def;
}

static void print_row(const moed_opt_spec *spec, const moed_opt *o, FILE *f)
{
    const int column = spec->help_column ? spec->help_column : MOED_OPT_HELP_COLUMN;
    const int width = spec->help_width ? spec->help_width : MOED_OPT_HELP_WIDTH;
    if (o->kind == MOED_OPT_SECTION) {
        fprintf(f, "\n%s\n", o->name);
        return;
    }
    int col = fprintf(f, "  --%s%s%s", o->name, o->arg ? " " : "", o->arg ? o->arg : "");
    if (col > column - 2) {
        fputc('\n', f);
        col = 0;
    }
    const char *h = o->help ? o->help : "", *def = shown_default(o);
    for (const char *nl; (nl = strchr(h, '\n')); h = nl + 1, col = 0)
        fprintf(f, "%*s%.*s\n", column - col, "", (int)(nl - h), h);
    col += fprintf(f, "%*s%s", column - col, "", h);
    if (def && (long)col + (long)strlen(def) + 11 > (long)width) { /* " (default " ")" */
        fprintf(f, "\n%*s", column, "");
        col = column;
    }
    if (def) fprintf(f, "%s(default %s)", col > column ? " " : "", def);
    fputc('\n', f);
}

void moed_opt_help(const moed_opt_spec *spec, const char *command, FILE *f)
{
    const moed_opt_cmd *cmd = find_cmd(spec, command);
    fputs(cmd->head, f);
    for (size_t i = 0; i < spec->n_opts; i++) {
        const moed_opt *o = &spec->opts[i];
        if (o->cmd ? command && !strcmp(o->cmd, command) : !command) print_row(spec, o, f);
    }
    if (cmd->tail) fprintf(f, "\n%s", cmd->tail);
}
