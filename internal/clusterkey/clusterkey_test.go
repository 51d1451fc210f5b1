package clusterkey

import (
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
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
		"a hex digit more":               {k, "d", v, append(append([]byte(nil), auth...), '0'), "32 hex bytes"},
		"not hex after the MAC":          {k, "d", v, append(append([]byte(nil), auth...), "zz"...), "32 hex bytes"},
		"no keys at all (a nil Keyring)": {nil, "d", v, auth, "no key"},
	} {
		err := tc.k.Verify(tc.domain, tc.value, tc.auth)
		if !errors.Is(err, ErrUnauthenticated) || !strings.Contains(err.Error(), tc.wantInDetail) {
			t.Errorf("%s: Verify = %v, want ErrUnauthenticated saying %q", name, err, tc.wantInDetail)
		}
	}
}

// An error about an unknown key id quotes at most its first 64 bytes: the id comes from a Kafka
// record, which may carry a megabyte of it.
func TestVerifyClipsAnUnknownKeyID(t *testing.T) {
	k := mustParse(t, mustGenerate(t, "k1"))
	long := strings.Repeat("x", 1<<20)
	err := k.Verify("d", []byte("v"), []byte(long+":"+strings.Repeat("ab", 32)))
	if !errors.Is(err, ErrUnauthenticated) || !strings.Contains(err.Error(), `key id "`+strings.Repeat("x", 64)+`... (`) {
		t.Fatalf("Verify = %.200v, want ErrUnauthenticated quoting the id's first 64 bytes", err)
	}
	if len(err.Error()) > 500 {
		t.Errorf("the error quotes %d bytes", len(err.Error()))
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

// Every refusal names the file, the line at fault (counting comments and blank lines, as an
// editor does), what is wrong with it, and how to make a key file.
func TestParseRefusals(t *testing.T) {
	good := strings.TrimSpace(mustGenerate(t, "k1"))
	for name, tc := range map[string]struct{ text, want string }{
		"empty":                {"# only a comment\n", "test.key holds no key"},
		"no colon":             {strings.Replace(good, ":", "", 1), "test.key:1: no ':' between the key id and the key"},
		"bad id":               {"k 1" + good[2:], `test.key:1: key id "k 1"`},
		"not hex":              {"k1:zz" + good[5:], "test.key:1: the key is not hex"},
		"short key":            {"k1:" + strings.Repeat("ab", 16), `test.key:1: key "k1" has 16 bytes, want at least 32`},
		"twice the same id":    {good + "\n" + good, `test.key:2: key id "k1" appears twice`},
		"no id":                {good[2:], `test.key:1: key id ""`},
		"an id of 65":          {strings.Repeat("k", 65) + good[2:], `test.key:1: key id "` + strings.Repeat("k", 65) + `"`},
		"an id with '/'":       {"k/1" + good[2:], `test.key:1: key id "k/1"`},
		"a 31-byte key":        {"k1:" + strings.Repeat("ab", 31), `test.key:1: key "k1" has 31 bytes`},
		"not hex at end":       {good + "zz", "test.key:1: the key is not hex"},
		"an odd hex digit":     {good + "0", "test.key:1: the key is not hex"},
		"a fault on line 5":    {"# keys\n\n" + good + "\n  \nk2:zz\n", "test.key:5: the key is not hex"},
		"a short id, no colon": {"k1\n", "test.key:1: no ':' between the key id and the key"},
	} {
		_, err := Parse([]byte(tc.text), "test.key")
		if err == nil {
			t.Errorf("%s: parsed", name)
			continue
		}
		if !strings.Contains(err.Error(), "test.key") || !strings.Contains(err.Error(), "gen-key") || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v: want the file named, %q, and how to make one", name, err, tc.want)
		}
	}
}

// A file of more than MaxKeys keys, or one that cannot be read to its end (a line longer than
// bufio.Scanner takes), is refused, naming the file and what to do: not read as the keys before the
// fault.
func TestParseRefusesTooManyKeysAndUnreadableFiles(t *testing.T) {
	var keys []string
	for i := range MaxKeys + 1 {
		keys = append(keys, mustGenerate(t, fmt.Sprintf("k%d", i)))
	}
	good := mustGenerate(t, "k1")
	for name, tc := range map[string]struct{ text, want string }{
		"MaxKeys+1 keys":        {strings.Join(keys, ""), "remove keys"},
		"a line of 70000 bytes": {good + "#" + strings.Repeat("x", 70000) + "\n", GenerateCommand},
	} {
		if _, err := Parse([]byte(tc.text), "test.key"); err == nil || !strings.Contains(err.Error(), "test.key") || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: Parse = %v, want a refusal naming test.key and saying %q", name, err, tc.want)
		}
	}
	if k, err := Parse([]byte(strings.Join(keys[:MaxKeys], "")), "test.key"); err != nil || len(k.IDs()) != MaxKeys {
		t.Errorf("MaxKeys keys: Parse = %v, want them all", err)
	}
}

// What a key file may hold: ids of 1 to 64 of A-Z a-z 0-9 . _ -, keys of 32 bytes or more (every
// byte of which counts), lines indented or ended "\r\n", and lines of only spaces (blank).
func TestParseAccepts(t *testing.T) {
	long := strings.Repeat("Az09._-x", 8)
	key32 := strings.Repeat("5a", 32)
	k := mustParse(t, "  \t\r\n "+long+":"+key32+"\r\n\t"+"b:"+key32+"c3"+"  \r\n")
	if ids := k.IDs(); len(ids) != 2 || ids[0] != long || ids[1] != "b" {
		t.Fatalf("IDs %q, want %q and b", ids, long)
	}
	short, longer := mustParse(t, "k:"+key32), mustParse(t, "k:"+key32+strings.Repeat("c3", 16))
	if v := []byte("v"); string(short.Sign("d", v)) == string(longer.Sign("d", v)) {
		t.Error("a key of 48 bytes signs as its first 32 bytes")
	}
}

// Generate refuses an id a key file would refuse, and draws every byte of the key at random.
func TestGenerate(t *testing.T) {
	for _, id := range []string{"", "a:b", "k 1", "k/1", strings.Repeat("k", 65)} {
		if line, err := Generate(id); err == nil {
			t.Errorf("Generate(%q) = %q, want a refusal", id, line)
		}
	}
	a, b := strings.TrimSpace(mustGenerate(t, "k")), strings.TrimSpace(mustGenerate(t, "k"))
	if len(a) != len("k:")+2*MinKeyBytes {
		t.Fatalf("Generate = %q, want k: and %d hex digits", a, 2*MinKeyBytes)
	}
	// Two keys share a given 8 bytes with probability 2^-64.
	for i := len("k:"); i < len(a); i += 16 {
		if a[i:i+16] == b[i:i+16] {
			t.Errorf("two generated keys share bytes %d to %d: %s, %s", (i-2)/2, (i-2)/2+7, a, b)
		}
	}
}

func TestLoad(t *testing.T) {
	if _, err := Load(""); err == nil || !strings.Contains(err.Error(), "replication.key_file") || !strings.Contains(err.Error(), "gen-key") {
		t.Errorf("Load(\"\") = %v, want a refusal naming replication.key_file and gen-key", err)
	}
	p := filepath.Join(t.TempDir(), "cluster.key")
	if _, err := Load(p); !errors.Is(err, fs.ErrNotExist) || !strings.Contains(err.Error(), p) || !strings.Contains(err.Error(), "gen-key") {
		t.Errorf("Load of a missing file = %v, want fs.ErrNotExist naming its path and gen-key", err)
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

// A key file is exposed when every user of the machine may read or write it; a file for its
// owner, or for its owner and group (a Kubernetes Secret mounted 0440 with fsGroup), is not.
func TestExposed(t *testing.T) {
	p := filepath.Join(t.TempDir(), "cluster.key")
	if err := os.WriteFile(p, []byte("k1:"+strings.Repeat("5a", 32)+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		mode    os.FileMode
		exposed bool
	}{{0o600, false}, {0o400, false}, {0o440, false}, {0o640, false}, {0o601, false}, {0o644, true}, {0o604, true}, {0o602, true}, {0o666, true}} {
		if err := os.Chmod(p, c.mode); err != nil {
			t.Fatal(err)
		}
		if mode, exposed := Exposed(p); exposed != c.exposed || mode != c.mode {
			t.Errorf("mode %v: Exposed = %v, %v; want %v", c.mode, mode, exposed, c.exposed)
		}
	}
	if _, exposed := Exposed(filepath.Join(t.TempDir(), "missing")); exposed {
		t.Error("a missing file is exposed")
	}
}

// UnknownKeys counts the failures under key ids the keyring lacks, and only those, and lists
// each id once, the first maxUnknownIDs of them in the order first seen.
func TestUnknownKeysTallies(t *testing.T) {
	k := mustParse(t, mustGenerate(t, "k1"))
	other := mustParse(t, mustGenerate(t, "k1")) // the same id, another secret: a bad MAC, not an unknown key
	var u UnknownKeys
	for i := range maxUnknownIDs + 2 {
		u.Add(k.Verify("d", []byte("v"), []byte(fmt.Sprintf("k%d:%s", i+2, strings.Repeat("ab", 32)))))
		u.Add(k.Verify("d", []byte("v"), []byte(fmt.Sprintf("k2:%s", strings.Repeat("ab", 32)))))
	}
	u.Add(k.Verify("d", []byte("v"), other.Sign("d", []byte("v"))))
	u.Add(errors.New("not an authentication failure"))
	u.Add(nil)
	if u.Records != 2*(maxUnknownIDs+2) {
		t.Errorf("Records = %d, want %d", u.Records, 2*(maxUnknownIDs+2))
	}
	if want := "k2, k3, k4, k5, k6, k7, k8, k9"; u.String() != want {
		t.Errorf("String() = %q, want %q", u.String(), want)
	}
}
