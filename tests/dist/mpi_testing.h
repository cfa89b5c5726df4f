// The main of the tests that run under mpirun (test_dist, test_ddp), in mpi_test_main.cpp: every rank runs
// every test; rank 0 prints gtest's usual output, the other ranks only their failures, prefixed with
// "[rank R]"; every rank exits non-zero when any rank failed, so mpirun does too. Tests must call the same
// collectives on every rank whatever their checks find (EXPECT, not ASSERT, after the first collective), so
// that a failure on one rank never leaves the others waiting.
#pragma once
#include "flashlm/dist.h"

// The job's world, for the duration of RUN_ALL_TESTS.
flashlm::Communicator& test_world();
