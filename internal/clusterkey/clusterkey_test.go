package clusterkey

import (
	"encoding/hex"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func mustGenerate(t *testing.T, id string) string {
	t.Helper()
	line, err := Generate(id)
	if err != nil {
		t.Fatal(err)
	}
	return line
}

func mustParse(t *testing.T, text string) *Keyring {
	t.Helper()
	k, err := Parse([]byte(text), "test.key")
	if err != nil {
		t.Fatal(err)
	}
	return k
}

func TestSignVerify(t *testing.T) {
	k := mustParse(t, "# the cluster's key\n\n"+mustGenerate(t, "k1"))
	v := []byte(`{"kind":"increment"}`)
	auth := k.Sign("d", v)
	if !strings.HasPrefix(string(auth), "k1:") || len(auth) != len("k1:")+64 {
		t.Fatalf("authenticator %q, want k1: and 64 hex digits", auth)
	}
	if err := k.Verify("d", v, auth); err != nil {
		t.Fatalf("Verify of its own signature: %v", err)
	}
	tampered := append([]byte(nil), v...)
	tampered[3] ^= 1
	other := mustParse(t, mustGenerate(t, "k1"))
	// A bit of the MAC flipped (not a bit of its hex digit, which can make it no digit at all:
	// 'f' ^ 1 is 'g').
	id, macHex, _ := strings.Cut(string(auth), ":")
	mac, err := hex.DecodeString(macHex)
	if err != nil || len(mac) != 32 {
		t.Fatalf("the authenticator %q is not id:<32 hex bytes>: %v", auth, err)
	}
	mac[len(mac)-1] ^= 1
	flipped := []byte(id + ":" + hex.EncodeToString(mac))
	for name, tc := range map[string]struct {
		k            *Keyring
		domain       string
		value, auth  []byte
		wantInDetail string
	}{
		"changed value":                  {k, "d", tampered, auth, "does not match"},
		"another domain":                 {k, "other", v, auth, "does not match"},
		"no authenticator":               {k, "d", v, nil, "no cfguard-auth"},
		"a MAC of another key, same id":  {other, "d", v, auth, "does not match"},
		"a flipped bit":                  {k, "d", v, flipped, "does not match"},
		"an unknown key id":              {k, "d", v, []byte("k9" + string(auth[2:])), `key id "k9"`},
		"not id:hex":                     {k, "d", v, []byte("garbage"), "not"},
		"a short MAC":                    {k, "d", v, []byte("k1:abcd"), "32 hex bytes"},
		"no keys at all (a nil Keyring)": {nil, "d", v, auth, "no key"},
	} {
		err := tc.k.Verify(tc.domain, tc.value, tc.auth)
		if !errors.Is(err, ErrUnauthenticated) || !strings.Contains(err.Error(), tc.wantInDetail) {
			t.Errorf("%s: Verify = %v, want ErrUnauthenticated saying %q", name, err, tc.wantInDetail)
		}
	}
}

// Rotation: a key added after the old one verifies; moved first, it signs, and what the old
// key signed still verifies.
func TestRotation(t *testing.T) {
	old, next := mustGenerate(t, "k1"), mustGenerate(t, "k2")
	v := []byte("entry")
	before := mustParse(t, old)
	signedOld := before.Sign("d", v)
	added := mustParse(t, old+next)
	if err := added.Verify("d", v, signedOld); err != nil {
		t.Fatalf("with k2 added: %v", err)
	}
	if got := added.Sign("d", v); !strings.HasPrefix(string(got), "k1:") {
		t.Errorf("with k2 added second, %q signs; want k1", got)
	}
	rotated := mustParse(t, next+old)
	signedNew := rotated.Sign("d", v)
	if !strings.HasPrefix(string(signedNew), "k2:") {
		t.Fatalf("with k2 first, %q signs; want k2", signedNew)
	}
	for name, k := range map[string]*Keyring{"k1 then k2": added, "k2 then k1": rotated} {
		for _, auth := range [][]byte{signedOld, signedNew} {
			if err := k.Verify("d", v, auth); err != nil {
				t.Errorf("%s: Verify(%s): %v", name, auth[:2], err)
			}
		}
	}
	if err := before.Verify("d", v, signedNew); !errors.Is(err, ErrUnauthenticated) {
		t.Errorf("a replica that only knows k1 verifies k2's signature: %v", err)
	}
}

func TestParseRefusals(t *testing.T) {
	good := strings.TrimSpace(mustGenerate(t, "k1"))
	for name, text := range map[string]string{
		"empty":             "# only a comment\n",
		"no colon":          strings.Replace(good, ":", "", 1),
		"bad id":            "k 1" + good[2:],
		"not hex":           "k1:zz" + good[5:],
		"short key":         "k1:" + strings.Repeat("ab", 16),
		"twice the same id": good + "\n" + good,
	} {
		_, err := Parse([]byte(text), "test.key")
		if err == nil {
			t.Errorf("%s: parsed", name)
			continue
		}
		if !strings.Contains(err.Error(), "test.key") || !strings.Contains(err.Error(), "gen-key") {
			t.Errorf("%s: %v: want the file named and how to make one", name, err)
		}
	}
}

func TestLoad(t *testing.T) {
	if _, err := Load(""); err == nil || !strings.Contains(err.Error(), "replication.key_file") || !strings.Contains(err.Error(), "gen-key") {
		t.Errorf("Load(\"\") = %v, want a refusal naming replication.key_file and gen-key", err)
	}
	p := filepath.Join(t.TempDir(), "cluster.key")
	if _, err := Load(p); err == nil || !strings.Contains(err.Error(), p) {
		t.Errorf("Load of a missing file = %v, want its path named", err)
	}
	if err := os.WriteFile(p, []byte(mustGenerate(t, "a")+mustGenerate(t, "b")), 0o600); err != nil {
		t.Fatal(err)
	}
	k, err := Load(p)
	if err != nil {
		t.Fatal(err)
	}
	if ids := k.IDs(); len(ids) != 2 || ids[0] != "a" || ids[1] != "b" || k.Source() != p {
		t.Errorf("IDs %v, source %s", ids, k.Source())
	}
}
