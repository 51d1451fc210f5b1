// Package launch starts cfguard daemons for the test packages under daemon/internal/tests, with
// daemontest and the daemon's exported API only.
package launch

import (
	"context"
	"log/slog"
	"net/http"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/cfguard/cfguard/broker"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/daemon"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/daemon/internal/hooks"
)

// Running is a daemon a test started.
type Running = daemontest.Running[*daemon.Daemon]

// Daemon runs a daemon in-process on loopback: embedded broker, bundled model, HTTP API, all on
// ephemeral ports, state in a temporary directory, on daemontest.Config(t, mutate); it waits
// until the daemon is ready. The test's cleanup stops it.
func Daemon(t testing.TB, mutate func(c *config.Config)) *Running {
	t.Helper()
	return With(t, mutate, nil, nil).WaitReady(t, "readyz", 20*time.Second)
}

// TLS is Daemon for a daemon serving HTTPS (http.web_config_file): client speaks TLS to it, and
// Base is https://.
func TLS(t testing.TB, mutate func(c *config.Config), client *http.Client) *Running {
	t.Helper()
	return With(t, mutate, nil, client).WaitReady(t, "readyz", 20*time.Second)
}

// NoWait is With without options or TLS: a daemontest.StartFunc.
func NoWait(t testing.TB, mutate func(c *config.Config)) *Running {
	t.Helper()
	return With(t, mutate, nil, nil)
}

// With starts a daemon on daemontest.Config(t, mutate) with Options set by opts (after the
// test's own: the shared model for a replica, and an empty Hooks for opts to fill in) and, when
// client is not nil, speaks TLS to it with client; it does not wait for readiness.
func With(t testing.TB, mutate func(c *config.Config), opts func(o *daemon.Options), client *http.Client) *Running {
	t.Helper()
	c := daemontest.Config(t, mutate)
	bundledModel := daemontest.BundledModelOf(t, &c)
	return daemontest.StartWith(t, c, client, func(ctx context.Context, c *config.Config, log *slog.Logger, reg *prometheus.Registry, ready chan<- *daemon.Daemon) error {
		o := daemon.Options{Config: c, Logger: log, Registry: reg, Ready: ready, BundledModel: bundledModel, Hooks: &hooks.Set{}}
		if opts != nil {
			opts(&o)
		}
		return daemon.Run(ctx, o)
	})
}

// Replica starts replica id of the cluster on b with the test key file, and waits until it is
// ready.
func Replica(t testing.TB, b *broker.Broker, id string) *Running {
	t.Helper()
	return ReplicaKey(t, b, id, daemontest.WriteKeyFile(t, daemontest.ClusterKey))
}

// ReplicaKey is Replica with the key file keyFile.
func ReplicaKey(t testing.TB, b *broker.Broker, id, keyFile string) *Running {
	t.Helper()
	return daemontest.StartReplica(t, NoWait, b.Addrs(), id, keyFile)
}

// ReplicaAt is ReplicaKey for a cluster on the brokers at addrs.
func ReplicaAt(t testing.TB, addrs []string, id, keyFile string) *Running {
	t.Helper()
	return daemontest.StartReplica(t, NoWait, addrs, id, keyFile)
}
