package replicalog

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/cmd/cfguard/internal/proc"
	"github.com/cfguard/cfguard/internal/clusterkey"
	"github.com/cfguard/cfguard/internal/kafkatest"
	"github.com/cfguard/cfguard/postlog"
)

// A key file that lost the line the log's start was signed with (a rotation that removed it too
// early, docs/DEPLOY.md "The cluster key") finds records under its own key and no genesis it can
// read: new-epoch refuses, writing nothing, naming the key ids the file lacks, rather than a log
// without a genesis that the replicas' first start would give one.
func TestNewEpochNamesTheKeysItsFileLacks(t *testing.T) {
	l := newTestLog(t)        // genesis and claim signed under k1
	l.append(l.inc(0), false) // a record signed by no key
	line, err := clusterkey.Generate("k2")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	keyFile := filepath.Join(dir, "k2.key")
	if err := os.WriteFile(keyFile, []byte(line), 0o600); err != nil {
		t.Fatal(err)
	}
	k2, err := clusterkey.Load(keyFile)
	if err != nil {
		t.Fatal(err)
	}
	// A claim signed under k2 once the rotation moved it first.
	v, err := (&postlog.Entry{Format: postlog.Format, Kind: postlog.Claim, Seq: l.seq + 1, Term: 2, Writer: "r2/1", PosteriorSHA256: l.sha}).Encode()
	if err != nil {
		t.Fatal(err)
	}
	w := &kafka.Writer{Transport: kafkatest.Transport(t), Addr: kafka.TCP(l.b.Addrs()...), Topic: "cfguard.posterior", RequiredAcks: kafka.RequireAll}
	defer w.Close()
	if err := w.WriteMessages(context.Background(), kafka.Message{Value: v,
		Headers: []kafka.Header{{Key: clusterkey.Header, Value: k2.Sign(postlog.Domain, v)}}}); err != nil {
		t.Fatal(err)
	}

	code, out, errs := proc.RunCLI(t, "new-epoch", "--config", writeLogConfig(t, dir, l.b.Addrs(), keyFile), "--force")
	if code == 0 || out != "" {
		t.Fatalf("new-epoch with a key file without k1: exit %d, wrote %s", code, out)
	}
	for _, want := range []string{"and 2 records signed under key ids it does not hold (k1)", "replication.key_file " + keyFile, "nothing was written"} {
		if !strings.Contains(errs, want) {
			t.Errorf("new-epoch: %s\nwant it to say %q", errs, want)
		}
	}
}
