/* PLACEHOLDER (being written by the kernels helper): synthetic weights. */
#include "moed_synth.h"
