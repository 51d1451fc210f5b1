package ledger

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/cfguard/cfguard/certify"
)

func TestShareOffsetsAndRelease(t *testing.T) {
	l, dir := openTest(t, Options{})
	m := testModel(3)
	install(t, l, m)
	rng := rand.New(rand.NewPCG(1, 1))
	var ces []*CE
	for i := range 40 {
		ce := newCE(t, m, rng)
		ce.ID = fmt.Sprintf("%s%d", []string{"a-", "b-"}[i%2], i)
		ces = append(ces, ce)
	}
	if err := l.Put(context.Background(), ces...); err != nil {
		t.Fatal(err)
	}
	if _, ok, err := l.ShareOffset(3); err != nil || ok {
		t.Fatalf("ShareOffset of a partition never owned = %v, %v", ok, err)
	}
	if err := l.SetShareOffset(3, 120); err != nil {
		t.Fatal(err)
	}
	if err := l.SetShareOffset(4, 7); err != nil {
		t.Fatal(err)
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	l, err := Open(dir, Options{Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	if off, ok, err := l.ShareOffset(3); err != nil || !ok || off != 120 {
		t.Fatalf("ShareOffset(3) after reopening = %d, %v, %v; want 120", off, ok, err)
	}
	before, _ := l.Counts()
	n, err := l.ReleaseShare(context.Background(), 3, func(id string) bool { return strings.HasPrefix(id, "a-") })
	if err != nil || n != 20 {
		t.Fatalf("ReleaseShare = %d, %v; want 20 deleted", n, err)
	}
	after, _ := l.Counts()
	total := func(c map[certify.Status]int) (s int) {
		for _, v := range c {
			s += v
		}
		return s
	}
	if total(before)-total(after) != 20 {
		t.Errorf("counts %v -> %v, want 20 fewer", before, after)
	}
	for _, ce := range ces {
		_, err := l.Get(ce.ID)
		if strings.HasPrefix(ce.ID, "a-") != (err != nil) {
			t.Errorf("%s after the release: %v", ce.ID, err)
		}
	}
	if _, ok, _ := l.ShareOffset(3); ok {
		t.Error("the released partition keeps its offset")
	}
	if off, ok, _ := l.ShareOffset(4); !ok || off != 7 {
		t.Errorf("another partition's offset: %d, %v", off, ok)
	}
}
