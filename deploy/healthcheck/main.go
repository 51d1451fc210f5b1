// Command cfguard-healthcheck is the container image's HEALTHCHECK. The final image has no
// shell and no curl, so Docker runs this static binary: it sends GET to a cfguard health URL
// and exits 0 when the answer is 200 within the timeout and the daemon is not still starting
// (/healthz answers 200 {"status": "starting", "phase": ...} from the moment it binds its port),
// 1 otherwise (with the reason on stderr), which is what Docker's HEALTHCHECK and compose's
// "condition: service_healthy" read: a service that depends on cfguard starts once its API answers.
//
//	cfguard-healthcheck [-timeout 3s] [URL]   (default URL: http://127.0.0.1:8080/healthz)
//
// /healthz and /readyz need no token, so the check never holds a secret.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"time"
)

// DefaultURL is cfguard's liveness endpoint at the image's http.listen (0.0.0.0:8080).
const DefaultURL = "http://127.0.0.1:8080/healthz"

func main() {
	os.Exit(run(os.Args[1:], DefaultURL, os.Stderr))
}

// run checks the URL in args, or defaultURL when args name none, and returns the exit code.
func run(args []string, defaultURL string, stderr io.Writer) int {
	fs := flag.NewFlagSet("cfguard-healthcheck", flag.ContinueOnError)
	fs.SetOutput(stderr)
	timeout := fs.Duration("timeout", 3*time.Second, "give up after this long")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	url := defaultURL
	switch fs.NArg() {
	case 0:
	case 1:
		url = fs.Arg(0)
	default:
		fmt.Fprintf(stderr, "cfguard-healthcheck: at most one URL, got %v\n", fs.Args())
		return 2
	}
	ctx, cancel := context.WithTimeout(context.Background(), *timeout)
	defer cancel()
	if err := check(ctx, url); err != nil {
		fmt.Fprintf(stderr, "cfguard-healthcheck: %v\n", err)
		return 1
	}
	return 0
}

// check sends GET url and wants 200 from a daemon that is not starting.
func check(ctx context.Context, url string) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %s: %s", url, resp.Status, body)
	}
	var health struct {
		Status, Phase string
	}
	if json.Unmarshal(body, &health) == nil && health.Status == "starting" {
		return fmt.Errorf("GET %s: still starting: %s", url, health.Phase)
	}
	return nil
}
