/*
 * routing — the synthetic routings the kernel benchmarks draw (bench.h): the same rule in moe-bench
 * and moe-split-bench, so their rows speak of the same load.
 */
#include "bench.h"

#include "moed_synth.h"

#include <math.h>
#include <string.h>

static double urand(uint64_t *rng)
{
    *rng = moed_splitmix64(*rng);
    return (double)(*rng >> 11) / 9007199254740992.0;
}

void bench_choose(const char *routing, int E, int k, uint64_t *rng, int32_t *out)
{
    for (int j = 0; j < k; j++) {
        int32_t e;
        int dup;
        do {
            if (!strcmp(routing, "zipf")) { /* P(e) ∝ 1/(e+1)^1.2, by inversion over the table */
                double u = urand(rng), z = 0, acc = 0;
                for (int i = 0; i < E; i++) z += pow(i + 1, -1.2);
                e = E - 1;
                for (int i = 0; i < E; i++)
                    if ((acc += pow(i + 1, -1.2) / z) >= u) {
                        e = i;
                        break;
                    }
            } else if (!strcmp(routing, "hot") && j == 0) {
                e = 0; /* every token sends one pair to expert 0 */
            } else if (!strcmp(routing, "empty")) {
                e = (int32_t)(urand(rng) * (E / 4 > k ? E / 4 : k)); /* three quarters idle */
            } else {
                e = (int32_t)(urand(rng) * E);
            }
            dup = 0;
            for (int i = 0; i < j; i++) dup |= out[i] == e;
        } while (dup);
        out[j] = e;
    }
}
