package experiment

import (
	"fmt"
	"io"
	"strings"
)

// PaperRow is one row of the paper's Table "Empirical example for the theoretical bound"
// (Wisconsin Breast Cancer, BNN, lr 1e-5, delta 0.05).
type PaperRow struct {
	Update        string
	P1, P2, KL, B float64
}

// PaperRows is that table, transcribed.
var PaperRows = []PaperRow{
	{"95%->96%", 0.9977, 0.9981, 0.000330, 0.9720},
	{"96%->97%", 0.9981, 0.9971, 0.000355, 0.9714},
	{"97%->98%", 0.9971, 0.9976, 0.000096, 0.9832},
	{"98%->99%", 0.9976, 0.9998, 0.000423, 0.9685},
	{"99%->100%", 0.9998, 0.9974, 0.000477, 0.9689},
}

// WriteMarkdown writes the rows of r beside the paper's table (PaperRows, matched by update),
// with the set-up that produced them and command as their provenance.
func (r *IncrementsResult) WriteMarkdown(w io.Writer, command string) error {
	var b strings.Builder
	c := r.Config
	fmt.Fprintf(&b, "Seed %d, lr %g, %d Adam iterations per update (%s objective, %s data); anchor test accuracy %.2f%%; "+
		"the CE: test row %d, class %d -> %d, p1 %.4f under the anchor.\nProduced by `%s`.\n\n",
		c.Seed, c.LR, c.Steps, c.Objective, c.UpdateData, 100*r.TestAccuracy, r.CE.TestIndex, r.CE.From, r.CE.Target, r.CE.P, command)
	b.WriteString("| update | p1 (ours) | p1 (paper) | p2 (ours) | p2 (paper) | KL (ours) | KL (paper) | bound (ours) | bound (paper) | holds (ours) | KL from the anchor (ours) |\n")
	b.WriteString("|---|---|---|---|---|---|---|---|---|---|---|\n")
	for _, row := range r.Rows {
		p := PaperRow{}
		for _, pr := range PaperRows {
			if pr.Update == row.Update {
				p = pr
			}
		}
		paper := func(v float64, f string) string {
			if p.Update == "" {
				return "—"
			}
			return fmt.Sprintf(f, v)
		}
		holds := "no"
		if row.Holds {
			holds = "yes"
		}
		fmt.Fprintf(&b, "| %s | %.4f | %s | %.4f | %s | %.3g | %s | %.4f | %s | %s | %.3g |\n", row.Update,
			row.P1, paper(p.P1, "%.4f"), row.P2, paper(p.P2, "%.4f"), row.KL, paper(p.KL, "%.3g"),
			row.Bound, paper(p.B, "%.4f"), holds, row.AnchorKL)
	}
	_, err := io.WriteString(w, b.String())
	return err
}
