package serving

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/daemon"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/daemon/internal/daemontest/launch"
	"github.com/cfguard/cfguard/internal/testnet"
	"github.com/cfguard/cfguard/internal/waitfor"
)

// A busy port stops the start before anything is written: state_dir is not even created, so
// the next start (with the port free, or with another model.path) is a first start as intended.
func TestBusyPortLeavesStateDirUntouched(t *testing.T) {
	busy, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close()
	for _, c := range []struct {
		key    string
		mutate func(c *config.Config)
	}{
		{"http.listen", func(c *config.Config) { c.HTTP.Listen = busy.Addr().String() }},
		{"kafka.embedded_listen", func(c *config.Config) { c.Kafka.EmbeddedListen = busy.Addr().String() }},
	} {
		t.Run(c.key, func(t *testing.T) {
			cfg := config.Default()
			cfg.StateDir = filepath.Join(t.TempDir(), "state")
			cfg.HTTP.Listen, cfg.Kafka.EmbeddedListen = "127.0.0.1:0", "127.0.0.1:0"
			c.mutate(&cfg)
			err := daemon.Run(context.Background(), daemon.Options{Config: &cfg, Logger: slog.New(slog.DiscardHandler), Registry: prometheus.NewRegistry()})
			if err == nil || !strings.Contains(err.Error(), c.key+" "+busy.Addr().String()) {
				t.Fatalf("start on a busy %s: %v, want an error naming the key and address", c.key, err)
			}
			if _, serr := os.Stat(cfg.StateDir); !errors.Is(serr, fs.ErrNotExist) {
				t.Fatalf("state_dir after the refused start: %v, want it not created (error was %v)", serr, err)
			}
			t.Logf("%v", err)
		})
	}
}

// GET /v1/counterfactuals without a status lists every CE; POST /v1/explain under an id that
// exists is refused before any generation runs, without internal error text.
func TestListAllAndExplainDuplicateID(t *testing.T) {
	r := launch.Daemon(t, nil)
	data := daemontest.Bundled(t)
	ids := daemontest.RegisterCEs(t, r, data, 3, "")
	code, body := r.Get(t, "/v1/counterfactuals")
	var page struct {
		Counterfactuals []struct {
			ID string `json:"id"`
		} `json:"counterfactuals"`
	}
	if code != 200 || json.Unmarshal(body, &page) != nil || len(page.Counterfactuals) != len(ids) {
		t.Fatalf("GET /v1/counterfactuals: %d %s; want all %d CEs", code, body, len(ids))
	}
	code, body = r.Do(t, "POST", "/v1/explain", "", map[string]any{"id": ids[0], "x": data.X[0]})
	if code != 409 || !strings.Contains(string(body), ids[0]) || strings.Contains(string(body), "ledger") {
		t.Fatalf("explain under an existing id: %d %s; want 409 naming the id, no internal text", code, body)
	}
	// The first generation trains and stores the VAE under state_dir/vae: none ran.
	if _, err := os.Stat(filepath.Join(r.Config.StateDir, "vae")); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("state_dir/vae after a request refused by its id: %v, want no VAE (no generation)", err)
	}
}

// TestGivenListenersAreServedAndClosed: with Options.HTTPListener and BrokerListener the daemon
// serves the API and the embedded broker on those sockets (it binds neither address itself:
// held by the test, they would be busy), and closes them when it stops; started again on the
// same ports, as a restart would be, it serves there again.
func TestGivenListenersAreServedAndClosed(t *testing.T) {
	httpPort, brokerPort := testnet.Reserve(t), testnet.Reserve(t)
	stateDir := filepath.Join(t.TempDir(), "state")
	for round := range 2 {
		r := launch.With(t, func(c *config.Config) {
			c.StateDir = stateDir
			c.HTTP.Listen, c.Kafka.EmbeddedListen = httpPort.Addr(), brokerPort.Addr()
		}, func(o *daemon.Options) { o.HTTPListener, o.BrokerListener = httpPort.Listen(t), brokerPort.Listen(t) }, nil)
		if got := fmt.Sprint(r.D.HTTPAddr(), r.D.BrokerAddrs()); got != fmt.Sprint(httpPort.Addr(), []string{brokerPort.Addr()}) {
			t.Fatalf("round %d: serving on %s, want %s %s", round, got, httpPort.Addr(), brokerPort.Addr())
		}
		waitfor.Cond(t, 20*time.Second, "readyz", func() bool { code, _ := r.Get(t, "/readyz"); return code == 200 })
		r.Stop(t)
		for _, addr := range []string{httpPort.Addr(), brokerPort.Addr()} {
			c, err := net.Dial("tcp", addr)
			if err == nil {
				c.Close()
				t.Fatalf("round %d: %s still accepts connections after the daemon stopped", round, addr)
			}
			if !errors.Is(err, syscall.ECONNREFUSED) {
				t.Fatalf("round %d: dialling %s after the daemon stopped: %v, want connection refused", round, addr, err)
			}
		}
	}
}

// A start refused for its configuration, before anything is bound, still closes the sockets
// Options gave it (Options.HTTPListener and BrokerListener): nothing answers on them once Run
// has returned.
func TestGivenListenersAreClosedWhenTheConfigurationIsRefused(t *testing.T) {
	httpPort, brokerPort := testnet.Reserve(t), testnet.Reserve(t)
	c := daemontest.Config(t, func(c *config.Config) {
		c.HTTP.Listen, c.Kafka.EmbeddedListen = httpPort.Addr(), brokerPort.Addr()
		c.Certify.Delta = 0.7 // outside (0, 0.5)
	})
	httpLn, brokerLn := httpPort.Listen(t), brokerPort.Listen(t)
	t.Cleanup(func() { httpLn.Close(); brokerLn.Close() })
	err := daemon.Run(context.Background(), daemon.Options{Config: &c, Logger: slog.New(slog.DiscardHandler), Registry: prometheus.NewRegistry(),
		HTTPListener: httpLn, BrokerListener: brokerLn})
	if err == nil || !strings.Contains(err.Error(), "certify.delta") {
		t.Fatalf("Run with certify.delta 0.7: %v, want an error naming certify.delta", err)
	}
	for _, addr := range []string{httpPort.Addr(), brokerPort.Addr()} {
		conn, err := net.Dial("tcp", addr)
		if err == nil {
			conn.Close()
			t.Fatalf("%s still accepts connections after Run refused the configuration", addr)
		}
		if !errors.Is(err, syscall.ECONNREFUSED) {
			t.Fatalf("dialling %s after Run refused the configuration: %v, want connection refused", addr, err)
		}
	}
}
