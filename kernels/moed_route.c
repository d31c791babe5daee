/* PLACEHOLDER (being written by the kernels helper): routes and gating strategies. */
#include "moed_route.h"
