package bench

import (
	"fmt"
	"image/color"
	"path/filepath"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"
)

// Plot draws p50 (points and lines) for every series against x, with the p99
// as error bars, and saves it; the format follows the file extension (.svg,
// .png, .pdf).
func (r *Report) Plot(path string) error {
	ext := strings.ToLower(filepath.Ext(path))
	switch ext {
	case ".svg", ".png", ".pdf":
	default:
		return fmt.Errorf("--plot %s: use a .svg, .png or .pdf file name", path)
	}
	p := plot.New()
	p.Title.Text = "meshgpu bench " + r.Suite
	p.X.Label.Text = r.XLabel
	p.Y.Label.Text = "p50 " + r.Unit + " (bars: p99)"
	p.Legend.Top = true
	p.Add(plotter.NewGrid())
	if r.LogY && r.allPositive() { // a log axis cannot show zero
		p.Y.Scale = plot.LogScale{}
		p.Y.Tick.Marker = plot.LogTicks{Prec: -1}
	}
	for i, name := range r.Series() {
		var pts plotter.XYs
		var errs plotter.YErrors
		for _, row := range r.Rows {
			if row.Series != name {
				continue
			}
			pts = append(pts, plotter.XY{X: row.X, Y: row.P50})
			errs = append(errs, struct{ Low, High float64 }{0, row.P99 - row.P50})
		}
		line, points, err := plotter.NewLinePoints(pts)
		if err != nil {
			return err
		}
		c := plotutil.Color(i)
		line.Color, points.Color = c, c
		points.Shape = plotutil.Shape(i)
		bars, err := plotter.NewYErrorBars(struct {
			plotter.XYer
			plotter.YErrorer
		}{pts, errs})
		if err != nil {
			return err
		}
		bars.Color = color.Gray{Y: 120}
		p.Add(line, points, bars)
		p.Legend.Add(name, line, points)
	}
	return p.Save(16*vg.Centimeter, 10*vg.Centimeter, path)
}

func (r *Report) allPositive() bool {
	for _, row := range r.Rows {
		if !(row.P50 > 0) || !(row.P99 > 0) {
			return false
		}
	}
	return len(r.Rows) > 0
}
