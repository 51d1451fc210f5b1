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

// logRotatedTooEarly is a log begun under k1 (a genesis and a claim), with a record signed by no
// key and a claim signed under k2, and a configuration whose key file holds k2 alone: a file that
// lost the line the log's start was signed with (a rotation that removed it too early,
// docs/DEPLOY.md "The cluster key").
func logRotatedTooEarly(t *testing.T) (config, keyFile string) {
	t.Helper()
	l := newTestLog(t)
	l.append(l.inc(0), false) // a record signed by no key
	line, err := clusterkey.Generate("k2")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	keyFile = filepath.Join(dir, "k2.key")
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
	return writeLogConfig(t, dir, l.b.Addrs(), keyFile), keyFile
}

// With a key file that lacks the log's first key, new-epoch finds records under its own key and
// no genesis it can read: it refuses, writing nothing, naming the key ids the file lacks, rather
// than a log without a genesis that the replicas' first start would give one.
func TestNewEpochNamesTheKeysItsFileLacks(t *testing.T) {
	config, keyFile := logRotatedTooEarly(t)
	code, out, errs := proc.RunCLI(t, "new-epoch", "--config", config, "--force")
	if code == 0 || out != "" {
		t.Fatalf("new-epoch with a key file without k1: exit %d, wrote %s", code, out)
	}
	for _, want := range []string{"and 2 records signed under key ids it does not hold (k1)", "replication.key_file " + keyFile, "nothing was written"} {
		if !strings.Contains(errs, want) {
			t.Errorf("new-epoch: %s\nwant it to say %q", errs, want)
		}
	}
}

// verify-log with that file accepts no entry: it exits 1 saying that some records authenticate
// and naming the key ids the file lacks, not that none of the log's records authenticates.
func TestVerifyLogNamesTheKeysItsFileLacks(t *testing.T) {
	config, keyFile := logRotatedTooEarly(t)
	code, _, errs := proc.RunCLI(t, "verify-log", "--config", config)
	if code != 1 {
		t.Fatalf("verify-log with a key file without k1: exit %d, %s; want 1", code, errs)
	}
	for _, want := range []string{"no genesis of cfguard.posterior authenticates under the keys of replication.key_file " + keyFile,
		"1 of its records do", "3 do not (key ids it does not hold: k1)"} {
		if !strings.Contains(errs, want) {
			t.Errorf("verify-log: %s\nwant it to say %q", errs, want)
		}
	}
}
