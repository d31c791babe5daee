/*
 * cli_num — the command-line tools' number parsing (moectl, moed-load): a whole string, in range,
 * or -1 so the caller can print a usage message that names the flag.
 */
#ifndef MOED_CLI_NUM_H
#define MOED_CLI_NUM_H

/* A decimal integer in [lo, hi]. */
int cli_int(const char *s, long long lo, long long hi, long long *out);
/* A finite number in [lo, hi]. */
int cli_double(const char *s, double lo, double hi, double *out);

#endif
