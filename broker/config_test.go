package broker

import (
	"crypto/tls"
	"strings"
	"testing"
	"time"
)

// TestApplyDefaultsBounds pins each bound of Config at its edge: the last value accepted and
// the first refused (a zero takes the default, so the bounds below are about the values a
// caller writes).
func TestApplyDefaultsBounds(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  Config
		want string // "" when accepted
	}{
		{"session timeout 1ms", Config{GroupMinSessionTimeout: time.Millisecond}, ""},
		{"session timeout below 1ms", Config{GroupMinSessionTimeout: time.Millisecond - 1}, "GroupMinSessionTimeout"},
		{"session timeout 5m", Config{GroupMinSessionTimeout: maxSessionTimeout}, ""},
		{"session timeout past 5m", Config{GroupMinSessionTimeout: maxSessionTimeout + 1}, "GroupMinSessionTimeout"},
		{"negative max connections", Config{MaxConnections: -1}, "MaxConnections"},
		{"negative idle timeout", Config{IdleTimeout: -1}, "IdleTimeout"},
		{"negative request timeout", Config{RequestTimeout: -1}, "RequestTimeout"},
		{"65536 partitions", Config{Partitions: 1 << 16}, ""},
		{"65537 partitions", Config{Partitions: 1<<16 + 1}, "Partitions"},
		{"TLS without a certificate", Config{TLS: &tls.Config{}}, "no certificate"},
		{"TLS with GetCertificate", Config{TLS: &tls.Config{GetCertificate: func(*tls.ClientHelloInfo) (*tls.Certificate, error) { return nil, nil }}}, ""},
		{"topic of 249 characters", Config{Topics: []string{strings.Repeat("a", 249)}}, ""},
		{"topic of 250 characters", Config{Topics: []string{strings.Repeat("a", 250)}}, "at most 249"},
		{`topic "."`, Config{Topics: []string{"."}}, `"." or ".."`},
		{`topic ".."`, Config{Topics: []string{".."}}, `"." or ".."`},
		{`topic "..."`, Config{Topics: []string{"..."}}, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := tc.cfg
			err := cfg.applyDefaults()
			switch {
			case tc.want == "" && err != nil:
				t.Fatalf("refused: %v", err)
			case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
				t.Fatalf("got %v, want an error naming %q", err, tc.want)
			}
		})
	}
}

// TestSegmentBytes: a quarter of RetentionBytes, between 64 KiB and 16 MiB; 16 MiB with no size
// limit.
func TestSegmentBytes(t *testing.T) {
	for _, tc := range []struct{ retention, want int64 }{
		{-1, 16 << 20}, {1000, 64 << 10}, {256 << 10, 64 << 10}, {1 << 20, 256 << 10}, {64 << 20, 16 << 20}, {1 << 30, 16 << 20},
	} {
		cfg := Config{RetentionBytes: tc.retention}
		if got := cfg.segmentBytes(); got != tc.want {
			t.Errorf("RetentionBytes %d: segment of %d bytes, want %d", tc.retention, got, tc.want)
		}
	}
}
