/*
 * load_metrics — scraping moed_expert_tokens_total from the daemons (load_metrics.h).
 */
#include "load_metrics.h"

#include <errno.h>
#include <netdb.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#define SCRAPE_MAX     (64u << 20)
#define SCRAPE_TIMEOUT 10

/* A connected socket to addr ("host:port", "[v6]:port"), or -1 with err filled. */
static int dial(const char *addr, moed_error *err)
{
    char host[256];
    const char *colon = strrchr(addr, ':');
    if (!colon || colon == addr || (size_t)(colon - addr) >= sizeof host)
        return moed_fail(err, MOED_EINVAL, "--metrics %s: not host:port", addr), -1;
    const char *h = addr;
    size_t hl = (size_t)(colon - addr);
    if (*h == '[' && hl >= 2 && h[hl - 1] == ']') h++, hl -= 2;
    snprintf(host, sizeof host, "%.*s", (int)hl, h);
    struct addrinfo hints = { .ai_socktype = SOCK_STREAM }, *ai = NULL;
    int rc = getaddrinfo(host, colon + 1, &hints, &ai), fd = -1;
    if (rc) return moed_fail(err, MOED_EIO, "--metrics %s: %s", addr, gai_strerror(rc)), -1;
    for (struct addrinfo *a = ai; a && fd < 0; a = a->ai_next) {
        fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
        if (fd < 0) continue;
        struct timeval tv = { SCRAPE_TIMEOUT, 0 };
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
        setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
        if (connect(fd, a->ai_addr, a->ai_addrlen)) {
            close(fd);
            fd = -1;
        }
    }
    freeaddrinfo(ai);
    if (fd < 0) moed_fail(err, MOED_EIO, "--metrics %s: cannot connect: %s", addr, strerror(errno));
    return fd;
}

/* The whole answer to a GET of /metrics (malloc'd, NUL-terminated), or NULL with err filled. */
static char *get(const char *addr, const char *token, moed_error *err)
{
    int fd = dial(addr, err);
    if (fd < 0) return NULL;
    char req[4400];
    int n =
        snprintf(req, sizeof req, "GET /metrics HTTP/1.0\r\nHost: %s\r\n%s%s%s\r\n", addr,
                 token ? "Authorization: Bearer " : "", token ? token : "", token ? "\r\n" : "");
    size_t cap = 1 << 16, len = 0;
    char *buf = malloc(cap);
    if (!buf || n < 0 || (size_t)n >= sizeof req || send(fd, req, (size_t)n, MSG_NOSIGNAL) != n) {
        moed_fail(err, MOED_EIO, "--metrics %s: cannot send the request", addr);
        goto fail;
    }
    for (;;) {
        if (len + 1 == cap) {
            char *grown = cap < SCRAPE_MAX ? realloc(buf, cap *= 2) : NULL;
            if (!grown) {
                moed_fail(err, MOED_EIO, "--metrics %s: the answer is over %u MiB", addr,
                          SCRAPE_MAX >> 20);
                goto fail;
            }
            buf = grown;
        }
        ssize_t got = recv(fd, buf + len, cap - len - 1, 0);
        if (got < 0) {
            moed_fail(err, MOED_EIO, "--metrics %s: %s", addr, strerror(errno));
            goto fail;
        }
        if (!got) break;
        len += (size_t)got;
    }
    close(fd);
    buf[len] = 0;
    return buf;
fail:
    close(fd);
    free(buf);
    return NULL;
}

int load_metrics_scrape(const char *addr, const char *token, load_experts *x, moed_error *err)
{
    char *text = get(addr, token, err);
    if (!text) return MOED_EIO;
    int status = 0;
    if (sscanf(text, "HTTP/1.%*d %d", &status) != 1 || status != 200) {
        char *nl = strchr(text, '\r');
        if (nl) *nl = 0;
        moed_fail(err, MOED_EIO, "--metrics %s answered '%.80s'%s", addr, text,
                  status == 401 ? ": give --metrics-token-file" : "");
        free(text);
        return MOED_EIO;
    }
    static const char name[] = "\nmoed_expert_tokens_total{";
    for (const char *p = strstr(text, name); p; p = strstr(p + 1, name)) {
        int layer, expert;
        double v;
        if (sscanf(p + sizeof name - 1, "layer=\"%d\",expert=\"%d\"} %lf", &layer, &expert, &v) ==
                3 &&
            v >= 0)
            load_experts_add(x, layer, expert, (uint64_t)v);
    }
    free(text);
    return 0;
}

int load_metrics_scrape_all(const char *addrs, const char *token, load_experts *x, moed_error *err)
{
    char *copy = strdup(addrs), *save = NULL;
    int rc = copy ? 0 : moed_fail(err, MOED_ENOMEM, "out of memory");
    for (char *a = copy ? strtok_r(copy, ",", &save) : NULL; a && !rc;
         a = strtok_r(NULL, ",", &save))
        rc = load_metrics_scrape(a, token, x, err);
    free(copy);
    return rc;
}
