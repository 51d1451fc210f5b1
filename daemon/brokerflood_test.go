package daemon

import (
	"fmt"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/internal/waitfor"
)

// TestEmbeddedBrokerConnectionFlood opens more idle TCP connections to the embedded broker
// than kafka.embedded_max_connections allows: the broker closes those beyond the limit, the
// API's /healthz still answers and /readyz says the broker is full; once the flood ends the
// daemon is ready again and a real client produces records the daemon consumes.
func TestEmbeddedBrokerConnectionFlood(t *testing.T) {
	const max, flood = 32, 200
	r := startDaemonWith(t, func(c *config.Config) {
		c.Kafka.EmbeddedMaxConnections = max
		c.Kafka.EmbeddedIdleTimeout = time.Hour // the flood stays until the test ends it
	}, nil, nil)
	waitfor.Cond(t, 30*time.Second, "ready", func() bool { code, _ := r.Get(t, "/readyz"); return code == http.StatusOK })
	addr := r.D.BrokerAddrs()[0]
	own := r.D.broker.Connections().Open // the daemon's own clients'
	var conns []net.Conn
	defer func() {
		for _, c := range conns {
			c.Close()
		}
	}()
	for range flood {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		conns = append(conns, c)
	}
	waitfor.Cond(t, 30*time.Second, "the broker full, refusing the rest of the flood", func() bool {
		s := r.D.broker.Connections()
		return s.Open == max && s.Refused > 0
	})
	if code, body := r.Get(t, "/healthz"); code != http.StatusOK {
		t.Errorf("/healthz during the flood: %d %s", code, body)
	}
	if code, body := r.Get(t, "/readyz"); code != http.StatusServiceUnavailable || !strings.Contains(string(body), "connection limit") {
		t.Errorf("/readyz during the flood: %d %s; want 503 naming the connection limit", code, body)
	}
	if s := r.D.broker.Connections(); s.Open > max {
		t.Errorf("the broker holds %d connections, over its limit %d", s.Open, max)
	}
	// The scrape says what the broker counts: full, at its limit, closing the rest at once.
	if limit := r.Metric(t, "cfguard_embedded_broker_max_connections"); limit != max {
		t.Errorf("cfguard_embedded_broker_max_connections %v, want %d", limit, max)
	}
	waitfor.Cond(t, 30*time.Second, "the scrape showing the broker full", func() bool {
		return r.Metric(t, "cfguard_embedded_broker_connections") == max
	})
	refused := r.D.broker.Connections().Refused
	if n := r.Metric(t, "cfguard_embedded_broker_connections_closed_total", "reason", "limit"); n < float64(refused) || refused == 0 {
		t.Errorf("cfguard_embedded_broker_connections_closed_total{reason=\"limit\"} %v, want at least the %d the broker counted before the scrape", n, refused)
	}
	for _, c := range conns {
		c.Close()
	}
	conns = nil
	waitfor.Cond(t, 60*time.Second, "ready again after the flood", func() bool { code, _ := r.Get(t, "/readyz"); return code == http.StatusOK })
	// Ready needs one free slot; the broker frees the flood's as it reads each one's end, and a
	// producer opens more than one connection: wait until the flood's slots are all free. The
	// broker may not have accepted all of the flood yet (on a busy core some wait in the
	// listener's queue, closed by now, and each takes a slot until its end is read): a Kafka
	// client that connects after them and is answered was accepted after all of them, since the
	// queue is first in, first out.
	waitfor.Cond(t, 60*time.Second, "a Kafka client connected after the flood answered", func() bool {
		c, err := kafka.Dial("tcp", addr)
		if err != nil {
			return false
		}
		_, err = c.ApiVersions()
		c.Close()
		return err == nil
	})
	waitfor.Cond(t, 60*time.Second, fmt.Sprintf("the flood's connections released (the daemon's own %d left)", own), func() bool {
		return r.D.broker.Connections().Open <= own && r.Metric(t, "cfguard_embedded_broker_connections") <= float64(own)
	})
	t.Logf("after the flood: %+v (the daemon's own before it: %d)", r.D.broker.Connections(), own)
	data := daemontest.Bundled(t)
	var vals [][]byte
	for i := range 64 {
		vals = append(vals, daemontest.Record(fmt.Sprintf("after-%d", i), data.X[i], data.Y[i]))
	}
	r.Produce(t, vals...)
	waitfor.Cond(t, 60*time.Second, "the records produced after the flood applied", func() bool {
		return r.Metric(t, "cfguard_records_total", "result", "applied") == 64
	})
}

// With a short kafka.embedded_idle_timeout (2s, below the 5s between two reads of the input
// topic's offsets), the daemon's own clients drop their idle connections first: no read of the
// offsets, by the watermarks reader or the consumer, goes out on a connection the broker closed.
func TestShortBrokerIdleTimeoutSparesOurClients(t *testing.T) {
	if testing.Short() {
		t.Skip("three reads of the offsets, 5s apart: not with -short")
	}
	t.Parallel() // waits
	r := startDaemon(t, func(c *config.Config) { c.Kafka.EmbeddedIdleTimeout = 2 * time.Second })
	_, first, _, _ := r.D.ends.get()
	waitfor.Cond(t, 60*time.Second, "three more reads of the input topic's offsets", func() bool {
		_, at, _, _ := r.D.ends.get()
		return at.Sub(first) >= 3*watermarksEvery-time.Second
	})
	for _, failed := range []string{"cannot read the input topic's offsets", "kafka broker operations failing"} {
		if strings.Contains(r.Logs.String(), failed) {
			t.Errorf("a request failed on a connection the broker closed (%q):\n%s", failed, r.Logs.String())
		}
	}
}
