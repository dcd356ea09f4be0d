"""The accelstats house style on grafana-foundation-sdk's builders (Grafana 11.6 types, dashboard schema 41).

``generate.py`` writes each dashboard with the SDK's ``Dashboard``/``Row`` builders and the panel
constructors below; each constructor returns the SDK builder of its visualisation (``timeseries.Panel``,
``stat.Panel``, ...) with the title, description, unit, size, queries and the house defaults set, and
the caller chains any other SDK setter (``.min(0)``, ``.mappings(...)``, ``.thresholds(...)``).

House defaults: every panel and query reads the Prometheus datasource chosen by the ``$datasource``
variable; tables, stats, bar gauges and pie charts run instant queries (tables in table format), time
series and state timelines range queries. Field and option names are the SDK's, which follow
Grafana's own CUE schemas (``grafana_foundation_sdk.models``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from grafana_foundation_sdk.builders import bargauge, piechart, prometheus, stat, statetimeline, table, timeseries
from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard as dash
from grafana_foundation_sdk.cog import builder as cogbuilder
from grafana_foundation_sdk.cog import variants
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as model
from grafana_foundation_sdk.models import piechart as piechart_model
from grafana_foundation_sdk.models import prometheus as prometheus_model

DATASOURCE = model.DataSourceRef(type_val="prometheus", uid="${datasource}")
#: Grafana value mappings as {value: (text, colour)}.
Mappings = dict[int, tuple[str, str]]


def query(expr: str, legend: str = "") -> prometheus.Dataquery:
    """One PromQL query on ``$datasource``; ``legend`` is Grafana's legend format (``{{label}}``), empty
    for Grafana's automatic one. The ref id and instant/range are set by the panel constructor."""
    return prometheus.Dataquery().expr(expr).legend_format(legend or "__auto").datasource(DATASOURCE)


def _targets(queries: Sequence[prometheus.Dataquery], *, instant: bool,
             fmt: prometheus_model.PromQueryFormat | None = None) -> list[cogbuilder.Builder[variants.Dataquery]]:
    """``queries`` with ref ids A, B, ... and the query type of the panel. Raises ValueError for none."""
    if not queries:
        raise ValueError("a panel needs at least one query")
    out: list[cogbuilder.Builder[variants.Dataquery]] = []
    for i, q in enumerate(queries):
        q = q.ref_id(chr(ord("A") + i))
        q = q.instant() if instant else q.range()
        out.append(q.format(fmt) if fmt is not None else q)
    return out


def thresholds(red_from: float | None = None) -> dash.ThresholdsConfig:
    """Green, and red from ``red_from`` on (absolute) when given."""
    steps = [model.Threshold(value=None, color="green")]
    if red_from is not None:
        steps.append(model.Threshold(value=red_from, color="red"))
    return dash.ThresholdsConfig().mode(model.ThresholdsMode.ABSOLUTE).steps(steps)


def value_mappings(mappings: Mappings) -> list[model.ValueMapping]:
    """One value mapping per value, in value order: {0: ("down", "red")} shows 0 as a red "down"."""
    options = {str(v): model.ValueMappingResult(text=text, color=colour, index=i)
               for i, (v, (text, colour)) in enumerate(sorted(mappings.items()))}
    return [model.ValueMap(options=options)]


def _legend(placement: common.LegendPlacement = common.LegendPlacement.BOTTOM) -> common_builders.VizLegendOptions:
    return (common_builders.VizLegendOptions().display_mode(common.LegendDisplayMode.LIST).placement(placement)
            .show_legend(True))


def _tooltip(mode: common.TooltipDisplayMode, sort: common.SortOrder) -> common_builders.VizTooltipOptions:
    return common_builders.VizTooltipOptions().mode(mode).sort(sort)


def _last_value() -> common_builders.ReduceDataOptions:
    return common_builders.ReduceDataOptions().calcs(["lastNotNull"]).fields("").values(False)


def ts(title: str, description: str, unit: str, queries: Sequence[prometheus.Dataquery], width: int = 12,
       height: int = 8) -> timeseries.Panel:
    """A time series of range queries: thin lines, light fill, no points, multi-series tooltip."""
    return (timeseries.Panel().title(title).description(description).unit(unit).span(width).height(height)
            .datasource(DATASOURCE).targets(_targets(queries, instant=False))
            .color_scheme(dash.FieldColor().mode(model.FieldColorModeId.PALETTE_CLASSIC)).thresholds(thresholds())
            .draw_style(common.GraphDrawStyle.LINE).line_width(1).fill_opacity(10)
            .show_points(common.VisibilityMode.NEVER).span_nulls(False).axis_placement(common.AxisPlacement.AUTO)
            .legend(_legend()).tooltip(_tooltip(common.TooltipDisplayMode.MULTI, common.SortOrder.DESCENDING)))


def timeline(title: str, description: str, unit: str, queries: Sequence[prometheus.Dataquery], width: int,
             height: int, mappings: Mappings) -> statetimeline.Panel:
    """A state timeline of range queries, values shown through ``mappings``."""
    return (statetimeline.Panel().title(title).description(description).unit(unit).span(width).height(height)
            .datasource(DATASOURCE).targets(_targets(queries, instant=False))
            .color_scheme(dash.FieldColor().mode(model.FieldColorModeId.PALETTE_CLASSIC)).thresholds(thresholds())
            .mappings(value_mappings(mappings)).fill_opacity(80).line_width(0)
            .show_value(common.VisibilityMode.AUTO).merge_values(True).row_height(0.9)
            .align_value(common.TimelineValueAlignment.LEFT).legend(_legend())
            .tooltip(_tooltip(common.TooltipDisplayMode.SINGLE, common.SortOrder.NONE)))


def single(title: str, description: str, unit: str, queries: Sequence[prometheus.Dataquery], width: int,
           height: int) -> stat.Panel:
    """A stat of the last value of instant queries, coloured background (green unless a threshold says)."""
    return (stat.Panel().title(title).description(description).unit(unit).span(width).height(height)
            .datasource(DATASOURCE).targets(_targets(queries, instant=True))
            .color_scheme(dash.FieldColor().mode(model.FieldColorModeId.THRESHOLDS)).thresholds(thresholds())
            .reduce_options(_last_value()).color_mode(common.BigValueColorMode.BACKGROUND)
            .graph_mode(common.BigValueGraphMode.NONE).justify_mode(common.BigValueJustifyMode.AUTO)
            .orientation(common.VizOrientation.AUTO).text_mode(common.BigValueTextMode.AUTO))


def bars(title: str, description: str, unit: str, queries: Sequence[prometheus.Dataquery], width: int = 12,
         height: int = 8) -> bargauge.Panel:
    """A horizontal gradient bar gauge of the last value of instant queries."""
    return (bargauge.Panel().title(title).description(description).unit(unit).span(width).height(height)
            .datasource(DATASOURCE).targets(_targets(queries, instant=True))
            .color_scheme(dash.FieldColor().mode(model.FieldColorModeId.THRESHOLDS)).thresholds(thresholds())
            .reduce_options(_last_value()).display_mode(common.BarGaugeDisplayMode.GRADIENT)
            .orientation(common.VizOrientation.HORIZONTAL).show_unfilled(True)
            .value_mode(common.BarGaugeValueMode.COLOR).name_placement(common.BarGaugeNamePlacement.AUTO)
            .sizing(common.BarGaugeSizing.AUTO))


def pie(title: str, description: str, unit: str, queries: Sequence[prometheus.Dataquery], width: int,
        height: int) -> piechart.Panel:
    """A pie chart of the last value of instant queries, legend on the right, labels name and value."""
    legend = (piechart.PieChartLegendOptions().display_mode(common.LegendDisplayMode.LIST)
              .placement(common.LegendPlacement.RIGHT).show_legend(True))
    return (piechart.Panel().title(title).description(description).unit(unit).span(width).height(height)
            .datasource(DATASOURCE).targets(_targets(queries, instant=True))
            .color_scheme(dash.FieldColor().mode(model.FieldColorModeId.THRESHOLDS)).thresholds(thresholds())
            .reduce_options(_last_value()).pie_type(piechart_model.PieChartType.PIE)
            .display_labels([piechart_model.PieChartLabels.NAME, piechart_model.PieChartLabels.VALUE])
            .legend(legend).tooltip(_tooltip(common.TooltipDisplayMode.SINGLE, common.SortOrder.NONE)))


def grid(title: str, description: str, unit: str, queries: Sequence[prometheus.Dataquery], width: int,
         height: int, columns: dict[str, str] | None = None,
         column_units: dict[str, str] | None = None) -> table.Panel:
    """A table of instant queries (table format), one row per series; several queries are merged on
    their labels. Time, __name__ and job are hidden; ``columns`` renames value columns
    ({"Value #A": "processes"}) and ``column_units`` gives value columns a unit."""
    columns, column_units = columns or {}, column_units or {}
    steps = [model.DataTransformerConfig(id_val="merge", options={})] if len(queries) > 1 else []
    steps.append(model.DataTransformerConfig(id_val="organize", options={
        "excludeByName": {"Time": True, "__name__": True, "job": True}, "renameByName": dict(columns),
        "indexByName": {}}))
    panel = (table.Panel().title(title).description(description).unit(unit).span(width).height(height)
             .datasource(DATASOURCE)
             .targets(_targets(queries, instant=True, fmt=prometheus_model.PromQueryFormat.TABLE))
             .color_scheme(dash.FieldColor().mode(model.FieldColorModeId.THRESHOLDS)).thresholds(thresholds())
             .align(common.FieldTextAlignment.AUTO).cell_options(common.TableColorTextCellOptions()).inspect(False)
             .show_header(True).cell_height(common.TableCellHeight.SM)
             .footer(common_builders.TableFooterOptions().show(False).reducer(["sum"]))
             .transformations(steps))
    for column, column_unit in column_units.items():
        panel = panel.override_by_name(columns.get(column, column),
                                       [model.DynamicConfigValue(id_val="unit", value=column_unit)])
    return panel


def datasource_variable() -> dash.DatasourceVariable:
    """The ``datasource`` variable: any Prometheus datasource."""
    return dash.DatasourceVariable("datasource").label("Data source").type("prometheus")


def query_variable(name: str, label: str, definition: str) -> dash.QueryVariable:
    """A multi-value variable filled by ``definition`` (``label_values(...)``) on ``$datasource``, with
    "All" = ``.*`` (matches the empty value too, so series without the label are kept)."""
    return (dash.QueryVariable(name).label(label).query(definition).datasource(DATASOURCE).multi(True)
            .include_all(True).all_value(".*").refresh(model.VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(model.VariableSort.ALPHABETICAL_ASC))


def custom_variable(name: str, label: str, values: Sequence[str]) -> dash.CustomVariable:
    """A single-value variable with fixed choices; the first is the default. Raises ValueError for none."""
    if not values:
        raise ValueError(f"variable {name}: no values")
    options = [model.VariableOption(selected=i == 0, text=v, value=v) for i, v in enumerate(values)]
    return (dash.CustomVariable(name).label(label).values(",".join(values)).multi(False).include_all(False)
            .current(model.VariableOption(selected=True, text=values[0], value=values[0])).options(options))


#: A titled row of panels: (title, SDK panel builders).
Row = tuple[str, Sequence[cogbuilder.Builder[model.Panel]]]


def dashboard(*, uid: str, title: str, description: str, tags: Sequence[str],
              variables: Sequence[dash.QueryVariable | dash.DatasourceVariable | dash.CustomVariable],
              rows: Sequence[Row]) -> model.Dashboard:
    """The dashboard: ``rows`` of (title, panels) laid out by the SDK's ``with_row``/``with_panel``
    (left to right, wrapping at 24 columns), panel ids numbered from 1 in that order, shared crosshair,
    last hour, 30 s refresh, a link menu to the other accelstats dashboards. Raises ValueError when a
    row's panels would run past the 24-column grid (the SDK's layout only wraps after a full line)."""
    builder = (dash.Dashboard(title).uid(uid).description(description).tags(list(tags)).editable()
               .tooltip(model.DashboardCursorSync.CROSSHAIR).time("now-1h", "now").refresh("30s").timezone("")
               .annotation(dash.AnnotationQuery().name("Annotations & Alerts").built_in(1).enable(True).hide(True)
                           .icon_color("rgba(0, 211, 255, 1)").type("dashboard")
                           .datasource(model.DataSourceRef(type_val="grafana", uid="-- Grafana --")))
               .link(dash.DashboardLink("accelstats").type(model.DashboardLinkType.DASHBOARDS).tags(["accelstats"])
                     .as_dropdown(True).include_vars(True).keep_time(True))
               .variables(list(variables)))
    for row_title, row_panels in rows:
        builder = builder.with_row(dash.Row(row_title))
        for panel in row_panels:
            builder = builder.with_panel(panel)
    built = builder.build()
    for pid, item in enumerate(built.panels or [], start=1):
        item.id_val = pid
        pos = item.grid_pos
        if pos is not None and pos.x + pos.w > 24:
            raise ValueError(f"{title} / {item.title}: x {pos.x} + width {pos.w} runs past the 24-column grid")
    return built


def to_json(built: model.Dashboard) -> str:
    """The dashboard as Grafana's JSON model, by the SDK's encoder (its field order); indented, newline-ended."""
    return json.dumps(built, cls=JSONEncoder, indent=2, ensure_ascii=False) + "\n"
