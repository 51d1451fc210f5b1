package daemon

import (
	"errors"
	"log/slog"
	"reflect"
	"strings"
	"testing"
)

func TestTeardownRunsEveryStepInReverseAndJoinsErrors(t *testing.T) {
	var order []string
	var logged strings.Builder
	td := teardown{log: slog.New(slog.NewTextHandler(&logged, nil))}
	step := func(name string, err error) {
		td.add(name, func() error { order = append(order, name); return err })
	}
	step("ledger", errors.New("fsync: input/output error"))
	step("broker", nil)
	step("http", errors.New("shutdown: context deadline exceeded"))
	err := td.run()
	if want := []string{"http", "broker", "ledger"}; !reflect.DeepEqual(order, want) {
		t.Fatalf("order %v, want %v", order, want)
	}
	if err == nil || !strings.Contains(err.Error(), "closing ledger: fsync") || !strings.Contains(err.Error(), "closing http: shutdown") {
		t.Fatalf("joined error %v", err)
	}
	if !strings.Contains(logged.String(), "step=ledger") || !strings.Contains(logged.String(), "step=http") {
		t.Fatalf("failures not logged by name: %s", logged.String())
	}
	if err := td.run(); err != nil {
		t.Fatalf("a second run repeats the steps: %v", err)
	}
}
