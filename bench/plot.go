package bench

import (
	"fmt"
	"image/color"
	"os"
	"path/filepath"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
)

// Plot draws p50 (points and lines) for every series against x, with the p99
// as error bars, or with PlotExtra set that column of the rows that have
// it (no bars), and saves it; the format follows the file extension (.svg,
// .png, .pdf). The legend sits in a strip right of the axes, so it never
// covers a point.
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
	if r.PlotExtra != "" {
		p.Y.Label.Text = r.PlotLabel
	}
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
			if r.PlotExtra != "" {
				if v, ok := row.Extra[r.PlotExtra]; ok {
					pts = append(pts, plotter.XY{X: row.X, Y: v})
				}
				continue
			}
			pts = append(pts, plotter.XY{X: row.X, Y: row.P50})
			errs = append(errs, struct{ Low, High float64 }{0, row.P99 - row.P50})
		}
		if len(pts) == 0 {
			continue
		}
		line, points, err := plotter.NewLinePoints(pts)
		if err != nil {
			return err
		}
		c := plotutil.Color(i)
		line.Color, points.Color = c, c
		points.Shape = plotutil.Shape(i)
		p.Add(line, points)
		if errs != nil {
			bars, err := plotter.NewYErrorBars(struct {
				plotter.XYer
				plotter.YErrorer
			}{pts, errs})
			if err != nil {
				return err
			}
			bars.Color = color.Gray{Y: 120}
			p.Add(bars)
		}
		p.Legend.Add(name, line, points)
	}
	// The legend is drawn by hand in its own strip: taken off the plot,
	// which would draw it over the data.
	legend := p.Legend
	p.Legend = plot.NewLegend()
	legend.Top, legend.Left = true, true
	w, h := 16*vg.Centimeter, 10*vg.Centimeter
	lw := legend.Rectangle(draw.Canvas{}).Size().X + vg.Centimeter/2
	c, err := draw.NewFormattedCanvas(w+lw, h, ext[1:])
	if err != nil {
		return err
	}
	dc := draw.New(c)
	p.Draw(draw.Crop(dc, 0, -lw, 0, 0))
	top := p.Title.TextStyle.Rectangle(p.Title.Text).Size().Y + p.Title.Padding
	legend.Draw(draw.Crop(dc, w+vg.Centimeter/4, 0, 0, -top))
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if _, err := c.WriteTo(f); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

func (r *Report) allPositive() bool {
	for _, row := range r.Rows {
		if !(row.P50 > 0) || !(row.P99 > 0) {
			return false
		}
	}
	return len(r.Rows) > 0
}
