/*
 * cli_num — number parsing for the command-line tools (see cli_num.h).
 */
#include "cli_num.h"

#include <math.h>
#include <stdlib.h>

int cli_int(const char *s, long long lo, long long hi, long long *out)
{
    char *end;
    long long v = strtoll(s, &end, 10);
    if (!*s || *end || v < lo || v > hi) return -1;
    *out = v;
    return 0;
}

int cli_double(const char *s, double lo, double hi, double *out)
{
    char *end;
    double v = strtod(s, &end);
    if (!*s || *end || !isfinite(v) || v < lo || v > hi) return -1;
    *out = v;
    return 0;
}
