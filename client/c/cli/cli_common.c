/*
 * cli_common — the options both tools share (cli_common.h states the contract).
 */
#include "cli_common.h"

#include "moed_route.h"

#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

enum { TOKEN_MAX = 4096 };

int cli_read_token(const moed_opt_spec *spec, const char *flag, const char *path, char **out)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    struct stat st;
    if (fd < 0)
        return moed_opt_usage(spec, "%s %s: cannot open it: %s", flag, path, strerror(errno));
    if (fstat(fd, &st) || !S_ISREG(st.st_mode)) {
        close(fd);
        return moed_opt_usage(spec, "%s %s is not a regular file", flag, path);
    }
    char line[TOKEN_MAX + 2];
    ssize_t n = read(fd, line, sizeof line - 1);
    close(fd);
    line[n > 0 ? n : 0] = 0;
    char *s = line + strspn(line, " \t"), *end = s + strcspn(s, "\r\n");
    while (end > s && isspace((unsigned char)end[-1])) end--;
    *end = 0;
    if (s == end) return moed_opt_usage(spec, "%s %s: its first line is empty", flag, path);
    if (end - s > TOKEN_MAX)
        return moed_opt_usage(spec, "%s %s: the token is over %d bytes", flag, path, TOKEN_MAX);
    *out = strdup(s);
    if (!*out) return moed_opt_usage(spec, "out of memory reading %s", flag);
    return 0;
}

int cli_conn_opts(const moed_opt_spec *spec, cli_conn *c, moedc_opts *out)
{
    memset(out, 0, sizeof *out);
    if (c->token && c->token_file)
        return moed_opt_usage(spec, "give --token or --token-file, not both");
    if (c->token_file && !c->token_read) {
        int rc = cli_read_token(spec, "--token-file", c->token_file, &c->token_read);
        if (rc) return rc;
    }
    out->bearer_token = c->token_file ? c->token_read : c->token;
    if (!c->tls_cert != !c->tls_key)
        return moed_opt_usage(spec, "%s needs %s: a client certificate goes with its key",
                              c->tls_cert ? "--tls-cert" : "--tls-key",
                              c->tls_cert ? "--tls-key" : "--tls-cert");
    out->tls = c->tls;
    out->tls_ca = c->tls_ca;
    out->tls_cert = c->tls_cert;
    out->tls_key = c->tls_key;
    out->tls_server_name = c->tls_server_name;
    return 0;
}

void cli_conn_free(cli_conn *c)
{
    free(c->token_read);
    c->token_read = NULL;
}

int cli_connect(const cli_conn *c, const moedc_opts *o, moedc **out, moedc_error *err)
{
    const char *t = c->target;
    if (!strncmp(t, "ipv4:", 5) || !strncmp(t, "ipv6:", 5) || !strchr(t, ','))
        return moedc_connect_many(&t, 1, o, out, err);
    char *copy = strdup(t), *save = NULL;
    int n = 0;
    const char **list = calloc(strlen(t) / 2 + 2, sizeof *list); /* at most one per comma, + 1 */
    if (!copy || !list) {
        free(copy);
        free(list);
        snprintf(err->msg, sizeof err->msg, "out of memory");
        return err->code = MOEDC_ENOMEM;
    }
    for (char *tok = strtok_r(copy, ",", &save); tok; tok = strtok_r(NULL, ",", &save))
        list[n++] = tok;
    int rc = moedc_connect_many(list, n, o, out, err);
    free(copy);
    free(list);
    return rc;
}

int cli_parse_strategy(const char *value, void *field, moed_error *err)
{
    (void)err; /* the row's want says what is wrong */
    int s = moed_gate_strategy_parse(value);
    if (s < 0) return -1;
    *(int *)field = s;
    return 0;
}

int cli_parse_on_off(const char *value, void *field, moed_error *err)
{
    (void)err;
    if (strcmp(value, "on") && strcmp(value, "off")) return -1;
    *(int *)field = !strcmp(value, "on") ? MOEDC_RENORM_ON : MOEDC_RENORM_OFF;
    return 0;
}
