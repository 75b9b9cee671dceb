// STUB: the attention kernel family goes here.
#include "common.cuh"
