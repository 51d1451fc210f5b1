package daemon

import (
	"context"
	"log/slog"
	"net/http"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/daemon/internal/hooks"

	"github.com/cfguard/cfguard/config"
)

type running = daemontest.Running[*Daemon]

// startDaemon runs a daemon in-process on loopback: embedded broker, bundled model, HTTP API,
// all on ephemeral ports, state in a temporary directory. The test's cleanup stops it.
func startDaemon(t *testing.T, mutate func(c *config.Config)) *running {
	t.Helper()
	return startDaemonWith(t, mutate, nil, nil).WaitReady(t, "readyz", 20*time.Second)
}

// startNoWait is startDaemonWith without options or TLS: a daemontest.StartFunc.
func startNoWait(t testing.TB, mutate func(c *config.Config)) *running {
	t.Helper()
	return startDaemonWith(t, mutate, nil, nil)
}

// startDaemonWith starts a daemon on daemontest.Config(t, mutate) with Options set by opts
// (after the test's own: the shared model for a replica, and an empty Hooks for opts to fill in)
// and, when client is not nil, speaks TLS to it with client; it does not wait for readiness.
func startDaemonWith(t testing.TB, mutate func(c *config.Config), opts func(o *Options), client *http.Client) *running {
	t.Helper()
	c := daemontest.Config(t, mutate)
	bundledModel := daemontest.BundledModelOf(t, &c)
	return daemontest.StartWith(t, c, client, func(ctx context.Context, c *config.Config, log *slog.Logger, reg *prometheus.Registry, ready chan<- *Daemon) error {
		o := Options{Config: c, Logger: log, Registry: reg, Ready: ready, BundledModel: bundledModel, Hooks: &hooks.Set{}}
		if opts != nil {
			opts(&o)
		}
		return Run(ctx, o)
	})
}
