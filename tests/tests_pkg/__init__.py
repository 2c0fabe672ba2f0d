"""A package of user code for the bring-your-own-model tests (`--model tests_pkg.mod:build`)."""
