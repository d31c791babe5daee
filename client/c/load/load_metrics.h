/*
 * load_metrics — what moed-load reads of the daemons' metrics endpoints (--metrics): the tokens
 * per expert they computed (moed_expert_tokens_total), so the report can say how the load spread
 * over the experts as the daemons counted it, whatever the routing.
 *
 * A plain HTTP/1.0 GET of /metrics (the daemon's endpoint speaks no TLS), with the bearer token of
 * --metrics-token-file when given, bounded in time (10 s) and size (64 MiB).
 */
#ifndef LOAD_METRICS_H
#define LOAD_METRICS_H

#include "load_report.h"
#include "moed_err.h"

/* Adds what the endpoint at addr ("host:port", as --metrics-listen) counts to x, for x's layers;
 * MOED_EIO naming the address and what went wrong. */
int load_metrics_scrape(const char *addr, const char *token, load_experts *x, moed_error *err);

/* Every endpoint of a comma-separated list, added up. */
int load_metrics_scrape_all(const char *addrs, const char *token, load_experts *x, moed_error *err);

#endif
