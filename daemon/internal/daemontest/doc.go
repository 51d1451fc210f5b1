// Package daemontest runs cfguard daemons in a test's process and talks to them as a client
// does: on loopback, on ephemeral ports, with state in the test's temporary directories.
//
// It does not import package daemon, so that the daemon's own tests can use it: a test hands
// StartWith a RunFunc that calls daemon.Run (with whatever options it sets), and gets back a
// Running that holds the daemon it started. The daemon's internal tests, which reach its
// unexported functions and fields, and the test packages under daemon/internal/tests, which use
// its exported API and its hooks (package hooks), start daemons through the same code.
//
// What is costly to make and the same for most tests is made once per test binary: the network
// a first start trains at the default model keys (SharedModelDir) and the VAE its first
// explanation trains (SharedVAEDir). Main sets them up and removes them.
package daemontest
