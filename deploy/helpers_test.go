package deploy

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/daemon"
	"github.com/cfguard/cfguard/internal/waitfor"
)

// repoRoot is the module's root (the tests run in deploy/).
func repoRoot(t testing.TB) string {
	t.Helper()
	root, err := filepath.Abs("..")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(root, "go.mod")); err != nil {
		t.Fatalf("module root not found above deploy/: %v", err)
	}
	return root
}

// httpGet returns the status and body of GET url with an optional bearer token.
func httpGet(url, token string) (int, []byte, error) {
	req, err := http.NewRequest(http.MethodGet, url, nil)
	if err != nil {
		return 0, nil, err
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, b, err
}

type testLog struct{ t testing.TB }

func (w testLog) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimSpace(string(p)))
	return len(p), nil
}

// startDaemon runs daemon.Run in-process on loopback (HTTP API and embedded broker on ephemeral
// ports, state in a temporary directory) with cfg as the starting point, and stops it when the
// test ends. It returns the running daemon once /readyz answers 200.
func startDaemon(t testing.TB, cfg config.Config) *daemon.Daemon {
	t.Helper()
	cfg.StateDir = t.TempDir()
	cfg.Model.ExportDir = ""
	cfg.HTTP.Listen = "127.0.0.1:0"
	cfg.Kafka.Brokers = nil
	cfg.Kafka.EmbeddedListen = "127.0.0.1:0"
	ctx, cancel := context.WithCancel(context.Background())
	ready := make(chan *daemon.Daemon, 1)
	done := make(chan error, 1)
	log := slog.New(slog.NewTextHandler(testLog{t}, &slog.HandlerOptions{Level: slog.LevelWarn}))
	go func() {
		done <- daemon.Run(ctx, daemon.Options{Config: &cfg, Logger: log, Registry: prometheus.NewRegistry(), Ready: ready})
	}()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("daemon stopped with %v", err)
			}
		case <-time.After(30 * time.Second):
			t.Error("daemon did not stop within 30 s of cancel")
		}
	})
	var d *daemon.Daemon
	select {
	case d = <-ready:
	case err := <-done:
		t.Fatalf("daemon failed to start: %v", err)
	case <-time.After(60 * time.Second):
		t.Fatal("daemon did not start within 60 s")
	}
	waitfor.Cond(t, 20*time.Second, "the daemon's /readyz", func() bool {
		code, _, err := httpGet("http://"+d.HTTPAddr()+"/readyz", "")
		return err == nil && code == 200
	})
	return d
}

// The binaries the Dockerfile's static stage builds, built once per test binary by
// deploy/docker/build.sh on the build context (see TestDockerBuildContext).
var (
	buildOnce sync.Once
	buildDir  string
	buildErr  error
	buildLog  string
	buildTook time.Duration
)

// staticBinaries builds (once) and returns the directory holding cfguard and
// cfguard-healthcheck as the image's static stage builds them.
func staticBinaries(t testing.TB) string {
	t.Helper()
	if runtime.GOOS != "linux" {
		t.Skip("the image is linux; build.sh is tested on linux")
	}
	buildOnce.Do(func() {
		root := repoRoot(t)
		var ctxDir string
		ctxDir, buildErr = os.MkdirTemp("", "cfguard-docker-context-")
		if buildErr != nil {
			return
		}
		scratch = append(scratch, ctxDir)
		if buildErr = copyBuildContext(root, ctxDir); buildErr != nil {
			return
		}
		buildDir = filepath.Join(ctxDir, ".out")
		start := time.Now()
		cmd := exec.Command("sh", "deploy/docker/build.sh", buildDir, "static")
		cmd.Dir = ctxDir
		out, err := cmd.CombinedOutput()
		buildTook, buildLog = time.Since(start), string(out)
		if err != nil {
			buildErr = fmt.Errorf("deploy/docker/build.sh %s static: %v\n%s", buildDir, err, out)
		}
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return buildDir
}

// scratch are directories made outside a test's TempDir (shared by several tests); TestMain
// removes them.
var scratch []string

func TestMain(m *testing.M) {
	code := m.Run()
	for _, d := range scratch {
		os.RemoveAll(d)
	}
	os.Exit(code)
}
