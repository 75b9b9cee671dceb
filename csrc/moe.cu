// STUB: the moe kernel family goes here.
#include "common.cuh"
