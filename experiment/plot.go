package experiment

import (
	"bytes"
	"errors"
	"fmt"
	"image/color"
	"math"
	"path/filepath"
	"sort"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"

	"github.com/cfguard/cfguard/internal/atomicfile"
)

// PlotIncrements draws p1, p2 and Theorem 1's bound across the updates, one colour per learning
// rate (p2 solid, p1 dashed, bound dotted), with the 1/2 decision threshold, and writes it
// atomically to path. The format follows the extension: .svg, .png or .pdf. Bounds below 0 say
// nothing and are drawn at 0, so that a large-lr run does not squash the others.
func PlotIncrements(path string, results map[float64]*IncrementsResult) error {
	format := strings.TrimPrefix(strings.ToLower(filepath.Ext(path)), ".")
	switch format {
	case "svg", "png", "pdf":
	default:
		return fmt.Errorf("plot %s: unknown format %q (want .svg, .png or .pdf)", path, format)
	}
	if len(results) == 0 {
		return errors.New("plot: no results")
	}
	lrs := make([]float64, 0, len(results))
	for lr, r := range results {
		if r == nil || len(r.Rows) == 0 {
			return fmt.Errorf("plot: lr %g has no rows", lr)
		}
		lrs = append(lrs, lr)
	}
	sort.Float64s(lrs)

	p := plot.New()
	p.Title.Text = "Theorem 1 across incremental last-layer updates"
	p.X.Label.Text = "update (training data %)"
	p.Y.Label.Text = "p(y' | x')"
	p.Y.Min, p.Y.Max = 0, 1.02
	// The legend sits in a blank band right of the last update.
	p.Legend.Top, p.Legend.Left = false, false
	p.Legend.ThumbnailWidth = vg.Points(28)
	grid := plotter.NewGrid()
	grid.Vertical.Color = nil // vertical lines would cross the legend band
	p.Add(grid)

	var ticks []plot.Tick
	for i, row := range results[lrs[0]].Rows {
		ticks = append(ticks, plot.Tick{Value: float64(i + 1), Label: row.Update})
	}
	p.X.Tick.Marker = plot.ConstantTicks(ticks)
	p.X.Min, p.X.Max = 0.8, float64(len(ticks))+2.6

	half, err := plotter.NewLine(plotter.XYs{{X: p.X.Min, Y: 0.5}, {X: float64(len(ticks)) + 0.2, Y: 0.5}})
	if err != nil {
		return fmt.Errorf("plot: %w", err)
	}
	half.Color, half.Width = color.Gray{Y: 120}, vg.Points(1)
	p.Add(half)
	p.Legend.Add("threshold 1/2", half)

	for i, lr := range lrs {
		rows := results[lr].Rows
		series := []struct {
			name   string
			dashes []vg.Length
			value  func(Row) float64
		}{
			{"p2", nil, func(r Row) float64 { return r.P2 }},
			{"p1", []vg.Length{vg.Points(6), vg.Points(3)}, func(r Row) float64 { return r.P1 }},
			{"bound", []vg.Length{vg.Points(1.5), vg.Points(2.5)}, func(r Row) float64 { return math.Max(r.Bound, 0) }},
		}
		for _, s := range series {
			xy := make(plotter.XYs, len(rows))
			for j, r := range rows {
				xy[j] = plotter.XY{X: float64(j + 1), Y: s.value(r)}
			}
			line, points, err := plotter.NewLinePoints(xy)
			if err != nil {
				return fmt.Errorf("plot: lr %g %s: %w", lr, s.name, err)
			}
			line.Color, line.Dashes, line.Width = plotutil.Color(i), s.dashes, vg.Points(1.5)
			points.Color, points.Shape, points.Radius = plotutil.Color(i), draw.CircleGlyph{}, vg.Points(2)
			p.Add(line, points)
			p.Legend.Add(fmt.Sprintf("%s  lr=%g", s.name, lr), line, points)
		}
	}
	wt, err := p.WriterTo(8*vg.Inch, 4.5*vg.Inch, format)
	if err != nil {
		return fmt.Errorf("plot: %w", err)
	}
	var buf bytes.Buffer
	if _, err := wt.WriteTo(&buf); err != nil {
		return fmt.Errorf("plot: render: %w", err)
	}
	return atomicfile.WriteFile(path, buf.Bytes())
}
