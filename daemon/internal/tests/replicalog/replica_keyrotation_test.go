package replicalog

import (
	"strings"
	"testing"

	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/internal/clusterkey"
	"github.com/cfguard/cfguard/postlog"
)

// A replica whose key file lost the key the log's start was signed with (a rotation that
// dropped the old line too early, docs/DEPLOY.md "The cluster key") reads entries under its
// own key and no genesis: its refusal names the key ids it lacks and the key file, rather than
// only a log that lost its start, whose remedy (a new epoch) would not help it.
func TestKeyFileWithoutTheLogsFirstKeyRefusesNamingIt(t *testing.T) {
	b, key, plog := emptyLog(t)
	old, err := clusterkey.Parse([]byte("k0:"+strings.Repeat("3c", 32)), "the key rotated out")
	if err != nil {
		t.Fatal(err)
	}
	first := &postlog.Entry{Format: postlog.Format, Kind: postlog.Claim, Seq: 1, Parent: strings.Repeat("ab", 32), Term: 1, Writer: "r9/1",
		Version: 0, ParentVersion: 0, PosteriorSHA256: strings.Repeat("cd", 32)}
	v, err := first.Encode()
	if err != nil {
		t.Fatal(err)
	}
	daemontest.RawProduce(t, b, "cfguard.posterior", 0, "e/1", v, kafka.Header{Key: clusterkey.Header, Value: old.Sign(postlog.Domain, v)})
	daemontest.RawProduce(t, b, "cfguard.posterior", 0, "e/1", v) // a record signed by no key
	daemontest.AppendEntry(t, plog, &postlog.Entry{Format: postlog.Format, Kind: postlog.Claim, Seq: 2, Parent: strings.Repeat("ef", 32), Term: 2,
		Writer: "r9/1", Version: 0, ParentVersion: 0, PosteriorSHA256: strings.Repeat("cd", 32)})

	err = runReplicaOnce(t, b, "r1", t.TempDir(), key)
	if err == nil {
		t.Fatal("the replica started on a log whose start it cannot authenticate")
	}
	for _, want := range []string{"cfguard.posterior", "and 1 records signed under key ids it does not hold (k0)", "replication.key_file " + key, "The cluster key"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("Run = %v\nwant it to say %q", err, want)
		}
	}
}
