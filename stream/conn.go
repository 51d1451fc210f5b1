package stream

import (
	"cmp"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"strings"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/segmentio/kafka-go/sasl"
	"github.com/segmentio/kafka-go/sasl/plain"
	"github.com/segmentio/kafka-go/sasl/scram"
)

// SASL mechanisms understood by SASL.Mechanism.
const (
	MechanismPlain       = "PLAIN"
	MechanismScramSHA256 = "SCRAM-SHA-256"
	MechanismScramSHA512 = "SCRAM-SHA-512"
)

// SASL holds SASL credentials. Its fields match broker.SASLConfig, so one converts to the
// other.
type SASL struct {
	// Mechanism is "PLAIN", "SCRAM-SHA-256" or "SCRAM-SHA-512".
	Mechanism string
	User      string
	Password  string
}

// ConnConfig is how to reach and authenticate to the Kafka cluster. The Consumer, its
// dead-letter writer, the Publisher and Ping all take one.
type ConnConfig struct {
	// Brokers are the bootstrap host:port addresses. Required.
	Brokers []string
	// TLS, when set, makes every connection use TLS with this client configuration.
	TLS *tls.Config
	// SASL, when set, authenticates every connection.
	SASL *SASL
	// ClientID is sent to the brokers with every request.
	// Default: "cfguard".
	ClientID string
	// DialTimeout bounds connecting (TCP, TLS and SASL handshakes).
	// Default: 10s.
	DialTimeout time.Duration
	// IdleTimeout closes a pooled connection idle for this long: below a broker's own idle
	// timeout, so that a request never goes out on a connection the broker has closed.
	// Default: kafka-go's, 30s.
	IdleTimeout time.Duration
}

func (c *ConnConfig) applyDefaults() error {
	if len(c.Brokers) == 0 {
		return errors.New("stream: Brokers: at least one broker address is required")
	}
	for _, b := range c.Brokers {
		if _, _, err := net.SplitHostPort(b); err != nil {
			return fmt.Errorf("stream: Brokers: %q is not host:port: %w", b, err)
		}
	}
	c.ClientID = cmp.Or(c.ClientID, "cfguard")
	c.DialTimeout = cmp.Or(c.DialTimeout, 10*time.Second)
	if c.DialTimeout < 0 {
		return fmt.Errorf("stream: DialTimeout %v must be positive", c.DialTimeout)
	}
	_, err := c.mechanism()
	return err
}

// mechanism returns the kafka-go SASL mechanism, nil without SASL.
func (c *ConnConfig) mechanism() (sasl.Mechanism, error) {
	s := c.SASL
	if s == nil {
		return nil, nil
	}
	if s.User == "" {
		return nil, errors.New("stream: SASL.User is empty")
	}
	switch strings.ToUpper(s.Mechanism) {
	case MechanismPlain:
		return plain.Mechanism{Username: s.User, Password: s.Password}, nil
	case MechanismScramSHA256:
		return scramMechanism(scram.SHA256, s)
	case MechanismScramSHA512:
		return scramMechanism(scram.SHA512, s)
	}
	return nil, fmt.Errorf("stream: SASL.Mechanism %q: want PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512", s.Mechanism)
}

func scramMechanism(algo scram.Algorithm, s *SASL) (sasl.Mechanism, error) {
	m, err := scram.Mechanism(algo, s.User, s.Password)
	if err != nil {
		return nil, fmt.Errorf("stream: SASL %s for user %q: %w", algo.Name(), s.User, err)
	}
	return m, nil
}

// dialer is used by the Reader (consumer group and fetches). applyDefaults must have run.
func (c *ConnConfig) dialer() *kafka.Dialer {
	m, _ := c.mechanism()
	return &kafka.Dialer{
		ClientID:      c.ClientID,
		Timeout:       c.DialTimeout,
		DualStack:     true,
		TLS:           c.TLS,
		SASLMechanism: m,
	}
}

// transport is used by Writers and the Client. applyDefaults must have run. Its background
// goroutines stop when ctx ends; its connections are closed by CloseIdleConnections.
func (c *ConnConfig) transport(ctx context.Context) *kafka.Transport {
	m, _ := c.mechanism()
	return &kafka.Transport{
		Context: ctx,
		// kafka-go caches metadata, errors included, for 6s by default; 2s lets writers see a
		// topic created or a leader moved sooner, for one small request per 2s.
		MetadataTTL: 2 * time.Second,
		Dial:        (&net.Dialer{Timeout: c.DialTimeout}).DialContext,
		DialTimeout: c.DialTimeout,
		IdleTimeout: c.IdleTimeout,
		ClientID:    c.ClientID,
		TLS:         c.TLS,
		SASL:        m,
	}
}

// Ping checks that the cluster is reachable and authenticates us: it asks the first broker
// that answers for metadata, and checks that every named topic exists. It is the readiness
// check of the daemon.
func Ping(ctx context.Context, conn ConnConfig, topics ...string) error {
	if err := conn.applyDefaults(); err != nil {
		return err
	}
	tr := conn.transport(ctx)
	defer tr.CloseIdleConnections()
	var errs []error
	for _, addr := range conn.Brokers {
		cl := &kafka.Client{Addr: kafka.TCP(addr), Transport: tr, Timeout: conn.DialTimeout}
		md, err := cl.Metadata(ctx, &kafka.MetadataRequest{Topics: topics})
		if err != nil {
			errs = append(errs, fmt.Errorf("broker %s: %w", addr, err))
			if ctx.Err() != nil {
				break
			}
			continue
		}
		for _, t := range md.Topics {
			if t.Error != nil {
				return fmt.Errorf("stream: ping: topic %q: %w", t.Name, t.Error)
			}
		}
		if len(topics) > 0 && len(md.Topics) != len(topics) {
			return fmt.Errorf("stream: ping: asked for topics %q, broker %s described %d", topics, addr, len(md.Topics))
		}
		return nil
	}
	return fmt.Errorf("stream: ping: no broker answered: %w", errors.Join(errs...))
}

// Dialer is a kafka-go dialer for c (Readers, consumer groups), with c's defaults applied.
func (c ConnConfig) Dialer() (*kafka.Dialer, error) {
	if err := c.applyDefaults(); err != nil {
		return nil, err
	}
	return c.dialer(), nil
}

// Transport is a kafka-go transport for c (Writers, Clients), with c's defaults applied. Its
// background goroutines stop when ctx ends; close its connections with CloseIdleConnections.
func (c ConnConfig) Transport(ctx context.Context) (*kafka.Transport, error) {
	if err := c.applyDefaults(); err != nil {
		return nil, err
	}
	return c.transport(ctx), nil
}
