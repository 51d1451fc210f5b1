package clusterkey_test

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"strings"
	"testing"

	"github.com/cfguard/cfguard/ceshare"
	"github.com/cfguard/cfguard/internal/clusterkey"
	"github.com/cfguard/cfguard/postlog"
)

// An authenticator is "<id>:<hex>" of HMAC-SHA-256(domain || 0x00 || id || 0x00 || value), as
// the package documentation says, computed here with crypto/hmac from that formula: the wire
// format is pinned, the key id included (a rotated key cannot pass off another's MAC).
func TestAuthenticatorIsTheDocumentedHMAC(t *testing.T) {
	secret := strings.Repeat("5a", 32)
	k, err := clusterkey.Parse([]byte("k7:"+secret), "test")
	if err != nil {
		t.Fatal(err)
	}
	raw, _ := hex.DecodeString(secret)
	h := hmac.New(sha256.New, raw)
	h.Write([]byte("cfguard posterior log entry v1\x00k7\x00{\"seq\":1}"))
	want := "k7:" + hex.EncodeToString(h.Sum(nil))
	if got := string(k.Sign(postlog.Domain, []byte(`{"seq":1}`))); got != want {
		t.Fatalf("Sign = %s, want %s", got, want)
	}
}

// Every kind of record the replicas sign has a domain of its own: an authenticator of one kind
// never verifies as another's, so a signed CE request, state, claim, tombstone or member's data
// cannot be offered as a posterior-log entry, nor one as the other.
func TestDomainsSeparateTheKindsOfRecord(t *testing.T) {
	k, err := clusterkey.Parse([]byte("k1:"+strings.Repeat("a5", 32)), "test")
	if err != nil {
		t.Fatal(err)
	}
	domains := []string{postlog.Domain, ceshare.Domain, ceshare.StateDomain, ceshare.TombstoneDomain, ceshare.ClaimDomain, ceshare.MemberDomain}
	value := []byte(`{"id":"a"}`)
	for _, signed := range domains {
		auth := k.Sign(signed, value)
		for _, verified := range domains {
			err := k.Verify(verified, value, auth)
			if (err == nil) != (signed == verified) {
				t.Errorf("signed in %q, verified in %q: %v", signed, verified, err)
			}
		}
	}
	// The posterior log's own check, on a record signed as a CE request.
	rec := postlog.Record{Value: value, Auth: ceshare.Sign(k, value)}
	if err := postlog.Authenticate(k, rec); err == nil {
		t.Error("a CE request's authenticator verified as a posterior-log entry's")
	}
}
