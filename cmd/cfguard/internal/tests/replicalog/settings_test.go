package replicalog

import (
	"github.com/cfguard/cfguard/cmd/cfguard/internal/command"
	"github.com/cfguard/cfguard/cmd/cfguard/internal/proc"

	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/cfguard/cfguard/internal/waitfor"
)

// verify-log re-executes with the settings the log's genesis records, not its --config file's:
// a replica process with update.kl_weight 2 and update.memory_records 3000 writes the log, and
// verify-log given a file with the defaults (kl_weight 8, memory_records 50000, which update
// the posterior differently) matches every increment and says whose settings it used.
func TestVerifyLogUsesTheLogsSettings(t *testing.T) {
	if testing.Short() {
		t.Skip("a replica process and a stream: not with -short")
	}
	brokers := proc.StartClusterBroker(t)
	root := t.TempDir()
	data, _, modelDir := proc.TrainModel(t, root)
	reps := proc.StartReplicas(t, root, 1, brokers, modelDir, "update:\n  kl_weight: 2\n  memory_records: 3000\n")
	s := proc.StartStream(brokers, data)
	best := int64(0) // the most the replica said the log covers
	waitfor.Progress(t, 60*time.Second, "the log to cover 128 records", func() (bool, string) {
		if v, ok := reps[0].View(); ok {
			best = max(best, proc.Covered(v))
		}
		return best >= 128, fmt.Sprintf("covers %d", best)
	})
	produced := s.End(t)
	proc.WaitAgree(t, "after the stream", reps, produced)

	dir := filepath.Join(root, "verifier")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	file := proc.WriteReplicaConfig(t, dir, "verifier", brokers, modelDir)
	code, out, errs := proc.RunCLI(t, "verify-log", "--config", file)
	var rep command.VerifyReport
	if err := json.Unmarshal([]byte(out), &rep); err != nil || code != 0 {
		t.Fatalf("verify-log: exit %d, %v\n%s\n%s", code, err, out, errs)
	}
	if rep.Increments == 0 || rep.Matched != rep.Increments || len(rep.Mismatches) > 0 {
		t.Fatalf("verify-log with the log's settings: %s", out)
	}
	if want := []string{"update.kl_weight", "update.memory_records"}; rep.Settings.From != "genesis at offset 0" || !slices.Equal(rep.Settings.DifferFromFile, want) {
		t.Fatalf("settings %+v, want the genesis's, differing from the file in %v", rep.Settings, want)
	}
	t.Logf("verify-log: %d increments matched with the log's settings (%v differ from the file)", rep.Matched, rep.Settings.DifferFromFile)
}
