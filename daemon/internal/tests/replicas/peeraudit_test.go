package replicas

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/cfguard/cfguard/ceshare"
	"github.com/cfguard/cfguard/cluster"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/daemon/internal/daemontest/launch"
	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/cfguard/cfguard/ledger"
	"github.com/cfguard/cfguard/stream"
)

// idleHooks are the ceshare.Hooks of a member that stores nothing.
type idleHooks struct{}

func (idleHooks) Acquire(context.Context, int) (int64, *ceshare.Witness, error) { return 0, nil, nil }
func (idleHooks) Apply(context.Context, int, []ceshare.Request, int64, *ceshare.Witness) error {
	return nil
}
func (idleHooks) Release(context.Context, int) error             { return nil }
func (idleHooks) Reset(context.Context, int, int64, int64) error { return nil }
func (idleHooks) Lost(context.Context, int, int64, int64) error  { return nil }

// An audit takes as long as a replica's share needs: POST /v1/audit asks every owner of CE
// partitions and waits for each one's report past cluster.PeerTimeout, which bounds the other questions
// to peers. Here the other owner is a member of the CE group whose API answers the audit
// cluster.PeerTimeout + 1 s after it is asked.
func TestClusterAuditWaitsForASlowPeer(t *testing.T) {
	if testing.Short() {
		t.Skip("a replica and an audit of more than peerTimeout: not with -short")
	}
	t.Parallel()
	b := daemontest.StartCluster(t, 1)
	r := launch.Replica(t, b, "r1")
	asked := make(chan struct{}, 1)
	slow := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		if req.Method != http.MethodPost || req.URL.Path != "/v1/audit" || req.Header.Get(cluster.HeaderForwarded) != "r1" {
			http.Error(w, "not an audit forwarded by r1", http.StatusBadRequest)
			return
		}
		select {
		case asked <- struct{}{}:
		default:
		}
		select {
		case <-time.After(cluster.PeerTimeout + time.Second):
		case <-req.Context().Done():
			return
		}
		json.NewEncoder(w).Encode(ledger.AuditReport{PosteriorVersion: r.D.Posterior().Version, Evaluated: 3})
	}))
	t.Cleanup(slow.Close)
	rc := r.Config.Replication
	m, err := ceshare.NewMember(context.Background(), ceshare.MemberConfig{Conn: stream.ConnConfig{Brokers: r.D.BrokerAddrs()}, Topic: rc.CETopic, Group: ceshare.GroupOf(r.Config.Kafka.GroupID),
		Partitions: rc.CEPartitions, ReplicaID: "slow", AdvertiseURL: slow.URL, Keys: r.D.Replica().Keys(),
		SessionTimeout: rc.SessionTimeout, HeartbeatInterval: rc.HeartbeatInterval}, idleHooks{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- m.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	waitfor.Cond(t, 60*time.Second, "the slow member owning CE partitions, r1 ready", func() bool {
		code, _ := r.Get(t, "/readyz")
		return len(m.Owned()) > 0 && code == http.StatusOK
	})

	// A rebalance leaves a partition without an owner for a moment (503): asked again, for at
	// most a minute. start is when the request that answered was sent.
	retryUntil := time.Now().Add(time.Minute)
	start := time.Now()
	code, body := r.Do(t, "POST", "/v1/audit", "", map[string]any{})
	for code == http.StatusServiceUnavailable && time.Now().Before(retryUntil) {
		time.Sleep(time.Second)
		start = time.Now()
		code, body = r.Do(t, "POST", "/v1/audit", "", map[string]any{})
	}
	select {
	case <-asked:
	default:
		t.Fatalf("the slow member was not asked to audit: %d %s", code, body)
	}
	var got cluster.AuditAnswer
	if err := json.Unmarshal(body, &got); code != http.StatusOK || err != nil || got.Replicas["slow"].Evaluated != 3 {
		t.Fatalf("POST /v1/audit with a peer that answers after %s: %d %s (%v); want 200 with its report", cluster.PeerTimeout+time.Second, code, body, err)
	}
	if took := time.Since(start); took < cluster.PeerTimeout {
		t.Fatalf("the audit answered after %s, before the slow member did", took)
	}
}
