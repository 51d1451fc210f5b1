package command

import (
	"context"
	"flag"
	"fmt"
	"io"

	"github.com/cfguard/cfguard/internal/cli"
	"github.com/cfguard/cfguard/internal/clusterkey"
)

// cmdGenKey prints a line of a cluster key file (replication.key_file): a new random key of
// clusterkey.MinKeyBytes bytes, named by --id.
func cmdGenKey(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("gen-key", flag.ContinueOnError)
	id := fs.String("id", "k1", "the key's id (1 to 64 of A-Z a-z 0-9 . _ -); a new key for a rotation needs a new id")
	if err := cli.ParseFlags(fs, args, stderr); err != nil {
		return err
	}
	line, err := clusterkey.Generate(*id)
	if err != nil {
		return fmt.Errorf("%w: --id: %v", cli.ErrUsage, err)
	}
	_, err = io.WriteString(stdout, line)
	return err
}
