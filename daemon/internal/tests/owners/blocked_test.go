package owners

import (
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/ceshare"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/daemon/internal/daemontest/launch"
	"github.com/cfguard/cfguard/internal/clusterkey"
	"github.com/cfguard/cfguard/internal/waitfor"
)

// A question about a blocked partition asked at a replica that does not own it is answered as
// its owner answers: 503 with Retry-After 60 (it takes an upgrade), for a read and for a list, in
// the API and in the UI.
func TestBlockedPartitionAnswersAlikeThroughAnyReplica(t *testing.T) {
	t.Parallel()
	b := daemontest.StartCluster(t, 1)
	r1, r2 := launch.Replica(t, b, "r1"), launch.Replica(t, b, "r2")
	reps := []*launch.Running{r1, r2}
	parts := r1.D.Share().Partitions()
	waitfor.Cond(t, 90*time.Second, "every CE partition owned by one ready replica, each owning some", func() bool {
		return daemontest.ShareReady(r1) && daemontest.ShareReady(r2) && len(r1.D.Share().Member().Owned())+len(r2.D.Share().Member().Owned()) == parts &&
			len(r1.D.Share().Member().Owned()) > 0 && len(r2.D.Share().Member().Owned()) > 0
	})
	const newer = "newer-1"
	p := ceshare.Partition(newer, parts)
	owner := r1
	if !slices.Contains(r1.D.Share().Member().Owned(), p) {
		owner = r2
	}
	value := fmt.Appendf(nil, `{"kind":"register","id":%q,"replica":"r9","at":%q,"ce":{},"condition":"x"}`, newer, time.Now().UTC().Format(time.RFC3339Nano))
	daemontest.RawProduce(t, b, owner.Config.Replication.CETopic, p, newer, value, kafka.Header{Key: clusterkey.Header, Value: ceshare.Sign(owner.D.Replica().Keys(), value)})
	waitfor.Cond(t, 30*time.Second, "the partition blocked at its owner", func() bool { return len(owner.D.Share().Member().Blocked()) == 1 })

	unknown := ""
	for k := 0; unknown == ""; k++ {
		if id := fmt.Sprintf("unknown-%d", k); ceshare.Partition(id, parts) == p {
			unknown = id
		}
	}
	for _, r := range reps {
		for _, path := range []string{"/v1/counterfactuals/" + unknown, "/v1/counterfactuals?limit=10", "/ui/counterfactuals/" + unknown, "/ui/counterfactuals"} {
			resp, err := r.Client.Get(r.Base + path)
			if err != nil {
				t.Fatal(err)
			}
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get("Retry-After") != "60" || !strings.Contains(string(body), "cannot read") {
				t.Errorf("GET %s at %s (owner %v): %d (Retry-After %q) %s; want 503, Retry-After 60, naming the block",
					path, r.Config.Replication.ReplicaID, r == owner, resp.StatusCode, resp.Header.Get("Retry-After"), body)
			}
		}
	}
}
