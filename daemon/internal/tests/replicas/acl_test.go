package replicas

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/segmentio/kafka-go/sasl/scram"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/daemon/internal/daemontest/launch"
	"github.com/cfguard/cfguard/internal/tooltest"
	"github.com/cfguard/cfguard/internal/waitfor"
)

// documentedACLs reads the kafka-acls.sh commands of the Markdown file path and returns the
// principal they allow and the ACLs they add, as a broker would store them. A flag the parser
// does not know fails the test, so that the docs cannot say more than the test checks.
func documentedACLs(t *testing.T, path string) (string, []kfake.ACL) {
	t.Helper()
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	// Commands, their continuation lines joined.
	var cmds [][]string
	var cur []string
	for _, line := range strings.Split(string(raw), "\n") {
		line = strings.TrimSpace(line)
		if cur == nil && !strings.HasPrefix(line, "kafka-acls.sh ") {
			continue
		}
		more := strings.HasSuffix(line, `\`)
		cur = append(cur, strings.Fields(strings.TrimSuffix(line, `\`))...)
		if !more {
			cmds, cur = append(cmds, cur), nil
		}
	}
	if len(cmds) == 0 {
		t.Fatalf("%s: no kafka-acls.sh command", path)
	}
	principal := ""
	var acls []kfake.ACL
	for _, c := range cmds {
		var ops []kmsg.ACLOperation
		type resource struct {
			kind kmsg.ACLResourceType
			name string
		}
		var res []resource
		pattern := kmsg.ACLResourcePatternTypeLiteral
		for i := 1; i < len(c); i++ {
			arg := func() string {
				i++
				if i == len(c) {
					t.Fatalf("%s: %s has no value: %q", path, c[i-1], strings.Join(c, " "))
				}
				return c[i]
			}
			switch c[i] {
			case "--add":
			case "--bootstrap-server":
				arg()
			case "--allow-principal":
				p := arg()
				if principal != "" && p != principal {
					t.Fatalf("%s: two principals, %s and %s", path, principal, p)
				}
				principal = p
			case "--operation":
				op, err := kmsg.ParseACLOperation(arg())
				if err != nil {
					t.Fatalf("%s: %v", path, err)
				}
				ops = append(ops, op)
			case "--topic":
				res = append(res, resource{kmsg.ACLResourceTypeTopic, arg()})
			case "--group":
				res = append(res, resource{kmsg.ACLResourceTypeGroup, arg()})
			case "--cluster":
				res = append(res, resource{kmsg.ACLResourceTypeCluster, "kafka-cluster"})
			case "--resource-pattern-type":
				if pattern, err = kmsg.ParseACLResourcePatternType(arg()); err != nil {
					t.Fatalf("%s: %v", path, err)
				}
			default:
				t.Fatalf("%s: kafka-acls.sh flag %s is not understood by this test", path, c[i])
			}
		}
		if len(ops) == 0 || len(res) == 0 {
			t.Fatalf("%s: a command with no operation or no resource: %q", path, strings.Join(c, " "))
		}
		for _, r := range res {
			for _, op := range ops {
				acls = append(acls, kfake.ACL{Resource: r.kind, Name: r.name, Pattern: pattern, Operation: op, Allow: true})
			}
		}
	}
	return principal, acls
}

// TestDocumentedACLsRunReplicasAndFenceOthers runs two replicas against a broker that enforces
// ACLs (nothing is allowed that no ACL allows, as with allow.everyone.if.no.acl.found=false),
// with exactly the ACLs docs/DEPLOY.md tells an operator to add for the replicas' principal:
// they ingest, agree on one posterior and store a CE. A principal that may only read the
// replicas' topics, as the docs allow others to, cannot write any of them. docs/DESIGN.md gives
// the same commands.
func TestDocumentedACLsRunReplicasAndFenceOthers(t *testing.T) {
	if testing.Short() {
		t.Skip("two replicas: not with -short")
	}
	t.Parallel() // replicas mostly wait for their groups
	principal, acls := documentedACLs(t, filepath.Join(tooltest.RepoRoot(t), "docs", "DEPLOY.md"))
	if p, design := documentedACLs(t, filepath.Join(tooltest.RepoRoot(t), "docs", "DESIGN.md")); p != principal || !slices.Equal(design, acls) {
		t.Fatalf("docs/DESIGN.md's kafka-acls.sh commands differ from docs/DEPLOY.md's")
	}
	user, ok := strings.CutPrefix(principal, "User:")
	if !ok {
		t.Fatalf("documented principal %q is not User:<name>", principal)
	}
	const mech = "SCRAM-SHA-256"
	var reads []kfake.ACL
	for _, topic := range []string{"cfguard.posterior", "cfguard.ce", "cfguard.ce.state"} {
		for _, op := range []kmsg.ACLOperation{kmsg.ACLOperationRead, kmsg.ACLOperationDescribe} {
			reads = append(reads, kfake.ACL{Resource: kmsg.ACLResourceTypeTopic, Name: topic, Pattern: kmsg.ACLResourcePatternTypeLiteral, Operation: op, Allow: true})
		}
	}
	kc, err := kfake.NewCluster(kfake.NumBrokers(1),
		kfake.EnableSASL(), kfake.EnableACLs(),
		kfake.Superuser(mech, "admin", "admin-secret"),
		kfake.User(mech, user, "replica-secret", acls...),
		kfake.User(mech, "reader", "reader-secret", reads...),
		kfake.SeedTopics(2, "cfguard.records"), kfake.SeedTopics(1, "cfguard.records.dlq", "cfguard.events"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(kc.Close) // after the replicas' cleanups
	key := daemontest.WriteKeyFile(t, daemontest.ClusterKey)
	start := func(id string) *launch.Running {
		r := launch.With(t, func(c *config.Config) {
			daemontest.ReplicaConfig(c, kc.ListenAddrs(), id, key)
			c.Kafka.SASL = config.SASL{Mechanism: mech, Username: user, Password: "replica-secret"}
		}, nil, nil)
		waitfor.Cond(t, 60*time.Second, id+" ready", func() bool { code, _ := r.Get(t, "/readyz"); return code == 200 })
		return r
	}
	reps := []*launch.Running{start("r1"), start("r2")}

	// Records produced by another principal (the admin) are ingested, and both replicas apply
	// the same head covering every one.
	data := daemontest.Bundled(t)
	// One record is damaged: it goes to the dead-letter topic.
	const n = 96
	vals := make([]kafka.Message, n)
	for i := range vals {
		vals[i] = kafka.Message{Value: daemontest.Record(fmt.Sprintf("rec-%d", i), data.X[i], data.Y[i])}
	}
	vals[n/2].Value = []byte(`{"id": "damaged", "features": [1,`)
	admin := saslTransport(t, mech, "admin", "admin-secret")
	w := &kafka.Writer{Transport: admin, Addr: kafka.TCP(kc.ListenAddrs()...), Topic: "cfguard.records", RequiredAcks: kafka.RequireAll}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	err = w.WriteMessages(ctx, vals...)
	cancel()
	if err != nil {
		t.Fatal(err)
	}
	w.Close()
	waitfor.Cond(t, 90*time.Second, "both replicas on one head covering every record", func() bool {
		a, b := reps[0].Model(t), reps[1].Model(t)
		covered := int64(0)
		for _, to := range a.Replication.Covers {
			covered += to
		}
		return covered == n && a.Version > 0 && a.Replication.SHA == b.Replication.SHA && a.Replication.Entry == b.Replication.Entry
	})

	// A CE registered at one replica is stored by its owner and read at both.
	_, xs, cfs := daemontest.CandidatePairs(t, reps[0].D.Posterior(), data, 400, 1)
	if code, body := reps[1].Do(t, "POST", "/v1/counterfactuals", "", map[string]any{"id": "ce-acl",
		"x": data.X[xs[0]], "x_cf": data.X[cfs[0]], "target": "benign"}); code != http.StatusCreated {
		t.Fatalf("register at r2: %d %s", code, body)
	}
	for _, r := range reps {
		if code, body := r.Get(t, "/v1/counterfactuals/ce-acl"); code != http.StatusOK {
			t.Errorf("GET ce-acl at %s: %d %s", r.Config.Replication.ReplicaID, code, body)
		}
	}

	// An audit at every owner publishes its events; the damaged record is in the dead-letter topic.
	adminClient := &kafka.Client{Addr: kafka.TCP(kc.ListenAddrs()...), Transport: admin}
	end := func(topic string) int64 {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		res, err := adminClient.ListOffsets(ctx, &kafka.ListOffsetsRequest{Topics: map[string][]kafka.OffsetRequest{topic: {kafka.LastOffsetOf(0)}}})
		if err != nil {
			t.Fatal(err)
		}
		ps := res.Topics[topic]
		if len(ps) != 1 || ps[0].Error != nil {
			t.Fatalf("%s: partitions %+v, want one without error", topic, ps)
		}
		return ps[0].LastOffset
	}
	if code, body := reps[0].Do(t, "POST", "/v1/audit", "", nil); code != http.StatusOK {
		t.Fatalf("POST /v1/audit: %d %s", code, body)
	}
	waitfor.Cond(t, 30*time.Second, "a record in the dead-letter topic and events in the events topic", func() bool {
		dlq, events := end("cfguard.records.dlq"), end("cfguard.events")
		return dlq == 1 && events > 0
	})

	// Nothing the replicas asked for was refused, the posterior topic's settings included.
	for _, r := range reps {
		for _, line := range strings.Split(r.Logs.String(), "\n") {
			if strings.Contains(line, "Authorization Failed") {
				t.Errorf("%s was refused what the documented ACLs should allow: %s", r.Config.Replication.ReplicaID, line)
			}
		}
	}

	// Another principal, with read access to the replicas' topics, is refused every write.
	reader := &kafka.Client{Addr: kafka.TCP(kc.ListenAddrs()...), Transport: saslTransport(t, mech, "reader", "reader-secret")}
	for _, topic := range []string{"cfguard.posterior", "cfguard.ce", "cfguard.ce.state"} {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		res, err := reader.Produce(ctx, &kafka.ProduceRequest{Topic: topic, Partition: 0, RequiredAcks: kafka.RequireAll,
			Records: kafka.NewRecordReader(kafka.Record{Time: time.Now(), Value: kafka.NewBytes([]byte(`{}`))})})
		cancel()
		if err == nil {
			err = res.Error
		}
		if !errors.Is(err, kafka.TopicAuthorizationFailed) {
			t.Errorf("a write to %s by a principal that may only read it: %v, want %v", topic, err, kafka.TopicAuthorizationFailed)
		}
	}
}

// saslTransport is a kafka-go transport of the test's own that authenticates as user.
func saslTransport(t *testing.T, mech, user, password string) *kafka.Transport {
	t.Helper()
	if mech != "SCRAM-SHA-256" {
		t.Fatalf("saslTransport: mechanism %s", mech)
	}
	m, err := scram.Mechanism(scram.SHA256, user, password)
	if err != nil {
		t.Fatal(err)
	}
	tr := &kafka.Transport{SASL: m}
	t.Cleanup(tr.CloseIdleConnections)
	return tr
}
