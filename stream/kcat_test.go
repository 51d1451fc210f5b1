package stream

import (
	"bytes"
	"context"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cfguard/cfguard/broker"
	"github.com/cfguard/cfguard/internal/tooltest"
)

func runTool(t *testing.T, stdin string, name string, args ...string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Stdin = strings.NewReader(stdin)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	if err := cmd.Run(); err != nil {
		t.Fatalf("%s %q: %v\nstderr: %s", name, args, err, errb.String())
	}
	return out.String()
}

// TestKcatInterop produces records with kcat (librdkafka) to the embedded broker, consumes
// them with our Consumer, and reads the dead-letter topic back with kcat, headers included.
func TestKcatInterop(t *testing.T) {
	kcat := tooltest.Command(t, "apt-get install kcat", "kcat")
	b := startBroker(t, broker.Config{})
	addr := b.Addrs()[0]
	lines := []string{
		"k0#" + goodRecord("kc0", 0),
		"k1#" + `{"id":"kc1","features":{"a":1,"b":2,"c":3},"label":"malicious"}`,
		"k2#" + `{"id":"kc-bad","features":[1,2],"label":0}`,
		"k3#" + goodRecord("kc3", 3),
	}
	runTool(t, strings.Join(lines, "\n")+"\n", kcat, "-P", "-b", addr, "-t", recordsTopic, "-p", "0", "-K", "#", "-X", "acks=all")

	c := newConsumer(t, consumerConfig(plainConn(b), "kcat"))
	incs := collect(t, c, 3, 20*time.Second)
	if got := ids(incs); !slices.Equal(got, []string{"kc0", "kc1", "kc3"}) {
		t.Fatalf("records produced by kcat: got %v, want [kc0 kc1 kc3]", got)
	}
	if r := incs[0].Records[1]; r.Label != 1 || !slices.Equal(r.X, []float64{1, 2, 3}) {
		t.Fatalf("map-form record from kcat decoded as %+v", r)
	}

	out := runTool(t, "", kcat, "-C", "-b", addr, "-t", deadTopic, "-p", "0", "-o", "beginning", "-c", "1", "-e",
		"-f", "%k|%h|%s\n")
	parts := strings.SplitN(strings.TrimSpace(out), "|", 3)
	if len(parts) != 3 || parts[0] != "k2" || parts[2] != `{"id":"kc-bad","features":[1,2],"label":0}` ||
		!strings.Contains(parts[1], HeaderReason+"="+ReasonWrongDimension) ||
		!strings.Contains(parts[1], HeaderSourceOffset+"=2") {
		t.Fatalf("kcat read the dead letter as %q", out)
	}
}
