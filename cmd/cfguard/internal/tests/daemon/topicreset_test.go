package daemon

import (
	"github.com/cfguard/cfguard/cmd/cfguard/internal/proc"

	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/internal/kafkatest"
	"github.com/cfguard/cfguard/internal/waitfor"
)

// TestRunAcceptTopicResetConfirmsAReset runs RUNBOOK's CfguardTopicReset remedy as an operator
// types it. A daemon applied n records of kafka.topic; the topic is deleted and recreated and m
// records are produced to it. The daemon stops ingest and its /readyz names the command; a
// plain restart keeps it stopped; `cfguard run --accept-topic-reset` reads the new topic from
// its start and applies all m records.
func TestRunAcceptTopicResetConfirmsAReset(t *testing.T) {
	if testing.Short() {
		t.Skip("starts daemon processes")
	}
	const topic, n, m = "cfguard.records", 32, 48 // whole increments of WriteConfig's 16 records
	addrs := proc.StartBroker(t).Addrs()
	set, _, modelDir := proc.TrainModel(t, t.TempDir())
	cfg := proc.WriteConfig(t, t.TempDir(), addrs[0], proc.AnyPort, "reset", modelDir)
	produce := func(prefix string, n int) {
		t.Helper()
		w := &kafka.Writer{Transport: kafkatest.Transport(t), Addr: kafka.TCP(addrs...), Topic: topic, RequiredAcks: kafka.RequireAll}
		defer w.Close()
		var msgs []kafka.Message
		for i := range n {
			v, _ := json.Marshal(map[string]any{"id": fmt.Sprintf("%s-%d", prefix, i), "features": set.X[i], "label": set.Y[i]})
			msgs = append(msgs, kafka.Message{Value: v})
		}
		if err := w.WriteMessages(context.Background(), msgs...); err != nil {
			t.Fatal(err)
		}
	}
	stop := func(c *proc.Child) {
		t.Helper()
		c.Cmd.Process.Signal(syscall.SIGTERM)
		if code := proc.ExitOf(t, c, 30*time.Second); code != 0 {
			t.Fatalf("exit %d after SIGTERM; log:\n%s", code, c.Log.String())
		}
	}
	// stoppedForReset waits for /readyz to report the reset, naming the topic and the flag, with
	// nothing of the new topic applied.
	stoppedForReset := func(c *proc.Child) {
		t.Helper()
		var body string
		waitfor.Cond(t, 30*time.Second, "readyz to report the reset", func() bool {
			var code int
			code, body = proc.Get(t, "http://"+c.Addr()+"/readyz")
			return code == http.StatusServiceUnavailable && strings.Contains(body, "was reset")
		})
		for _, s := range []string{topic, "--accept-topic-reset"} {
			if !strings.Contains(body, s) {
				t.Fatalf("readyz %q does not name %q", body, s)
			}
		}
		if a := c.AppliedAnswer(t); a != n {
			t.Fatalf("%d records applied while ingest is stopped, want %d", a, n)
		}
	}

	c := proc.StartChild(t, cfg, proc.AnyPort)
	produce("old", n)
	c.WaitApplied(t, n, "before the reset")
	kafkatest.RecreateTopic(t, addrs, topic, 1)
	produce("new", m)
	stoppedForReset(c)
	stop(c)

	c = proc.StartChild(t, cfg, proc.AnyPort)
	c.WaitUp(t)
	stoppedForReset(c)
	stop(c)

	c = proc.StartChild(t, cfg, proc.AnyPort, "--accept-topic-reset")
	c.WaitApplied(t, n+m, "after the confirmation")
	waitfor.Cond(t, 30*time.Second, "readyz 200", func() bool {
		code, _ := proc.Get(t, "http://"+c.Addr()+"/readyz")
		return code == http.StatusOK
	})
	stop(c)
}
