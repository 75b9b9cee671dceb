// STUB: the sampling kernel family goes here.
#include "common.cuh"
