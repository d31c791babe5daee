/* moed-load's report page: draws the runs in #moed-runs (moed-load --json documents, one per run)
 * with Chart.js, which load_html.c embeds beside this file: latency percentiles and throughput
 * against the load level (concurrency, or the rate asked), one line per run, so runs of other T,
 * transport or settings compare on one axis; where each level's mean latency went (queued and
 * computing on the server, the rest in transport and the client) and how many requests a launch
 * merged; and the tokens each expert computed, per layer, as a heat map (an SVG grid: Chart.js
 * has no heat-map type). Every string that comes from a run is set as text, never parsed as HTML.
 */
(function () {
    'use strict';
    const data = JSON.parse(document.getElementById('moed-runs').textContent);
    const runs = data.runs;
    const root = document.getElementById('report');
    const PALETTE = ['#1f77b4', '#d62728', '#2ca02c', '#9467bd', '#ff7f0e', '#17becf', '#8c564b',
                     '#e377c2', '#7f7f7f', '#bcbd22'];
    const PARTS = [['queue', 'queued on the server', '#f2a93b'],
                   ['compute', 'computing on the server', '#3b7dd8'],
                   ['rest', 'the rest: transport, encoding, the client', '#aab4c2']];
    const PERCENTILES = [['p50', []], ['p90', [6, 3]], ['p99', [2, 2]]];
    const SVG = 'http://www.w3.org/2000/svg';

    function el(tag, attrs, ...children) {
        const e = document.createElement(tag);
        for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
        for (const c of children) e.append(c instanceof Node ? c : String(c));
        return e;
    }

    function svg(tag, attrs) {
        const e = document.createElementNS(SVG, tag);
        for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
        return e;
    }

    const num = (v) => (typeof v === 'number' && isFinite(v) ? v : 0);
    const fmt = (v, digits) => num(v).toLocaleString('en-US', { maximumFractionDigits: digits });

    /* A run's name: the settings that tell it from the others (T and transport when none do). */
    const KEYS = [['tokens', 'T='], ['transport', ''], ['routing', ''], ['dtype', ''],
                  ['connections', 'connections '], ['threads', 'threads '], ['layers', 'layers '],
                  ['arrival', ''], ['target', ''], ['backend', ''], ['model', '']];
    const differ = KEYS.filter(([k]) => new Set(runs.map((r) => String(r[k]))).size > 1);
    const shown = differ.length ? differ : KEYS.slice(0, 2);
    runs.forEach((r, i) => {
        r.name = shown.map(([k, p]) => p + (r[k] === undefined ? '?' : r[k])).join(', ');
        r.color = PALETTE[i % PALETTE.length];
        r.levels = Array.isArray(r.levels) ? r.levels : [];
    });

    const closedLoop = (r) => r.mode !== 'open';
    const levelX = (r, l) => num(closedLoop(r) ? l.concurrency : l.rate_asked);
    const levelName = (r, l) => (closedLoop(r) ? 'c=' : 'r=') + fmt(levelX(r, l), 1);

    function header() {
        root.append(el('h1', {}, 'moed-load report'));
        const models = [...new Set(runs.map((r) => r.model + ' (' + r.backend + ')'))].join('; ');
        root.append(el('p', { class: 'sub' }, runs.length + (runs.length > 1 ? ' runs' : ' run') +
            ' of ' + models + ' — written ' + data.generated));
        const table = el('table', { id: 'runs' });
        const head = ['run', 'target', 'loop', 'tokens (T)', 'transport', 'routing', 'dtype',
                      'connections', 'levels', 'errors', 'result', 'from'];
        table.append(el('tr', {}, ...head.map((h) => el('th', {}, h))));
        for (const r of runs) {
            const errors = r.levels.reduce((s, l) => s + num(l.errors_total), 0);
            const name = el('td', {}, el('span', { class: 'swatch', style: 'background:' + r.color }),
                            r.name);
            table.append(el('tr', {}, name, el('td', {}, r.target),
                el('td', {}, closedLoop(r) ? 'closed' : 'open, ' + r.arrival),
                el('td', {}, r.tokens), el('td', {}, r.transport || 'inline'),
                el('td', {}, r.routing), el('td', {}, r.dtype),
                el('td', { class: 'num' }, r.connections), el('td', { class: 'num' }, r.levels.length),
                el('td', { class: 'num' }, errors),
                el('td', r.pass ? {} : { class: 'fail' }, r.pass ? 'pass' : 'FAIL'),
                el('td', {}, r.source || '')));
        }
        root.append(table);
    }

    /* Charts are made once the page is whole, so each measures its place in the final layout. */
    const pending = [];
    function plot(parent, title, config) {
        const canvas = el('canvas', { id: 'plot-' + (pending.length + 1), 'aria-label': title,
                                      role: 'img' });
        parent.append(el('div', { class: 'plot' }, canvas));
        config.options = Object.assign({
            animation: false,
            responsive: true,
            maintainAspectRatio: false,
            interaction: { mode: 'nearest', intersect: false },
        }, config.options);
        /* legend keys as short strokes, so a dashed line's key shows its dashes */
        config.options.plugins = Object.assign({ title: { display: true, text: title },
                                                 legend: { position: 'bottom',
                                                           labels: { boxWidth: 28, boxHeight: 2 } } },
                                               config.options.plugins);
        pending.push([canvas, config]);
    }

    /* A level axis: logarithmic when the levels span a factor of 8 or more (1, 2, 4 ... 64). */
    function levelAxis(group, title) {
        const xs = group.flatMap((r) => r.levels.map((l) => levelX(r, l))).filter((x) => x > 0);
        const lo = Math.min(...xs), hi = Math.max(...xs);
        return { type: xs.length && hi / lo >= 8 ? 'logarithmic' : 'linear',
                 title: { display: true, text: title } };
    }

    function versusLevel(parent, group, xTitle) {
        const latency = [], throughput = [];
        for (const r of group) {
            for (const [q, dash] of PERCENTILES)
                latency.push({ label: r.name + ' ' + q, borderColor: r.color, backgroundColor: r.color,
                               borderDash: dash, data: r.levels.filter((l) => num(l.ok) > 0)
                                   .map((l) => ({ x: levelX(r, l), y: num(l.latency_ms[q]) })) });
            throughput.push({ label: r.name + ' tokens/s', borderColor: r.color,
                              backgroundColor: r.color, yAxisID: 'y',
                              data: r.levels.map((l) => ({ x: levelX(r, l), y: num(l.tokens_per_s) })) });
            throughput.push({ label: r.name + ' requests/s', borderColor: r.color,
                              backgroundColor: r.color, borderDash: [6, 3], yAxisID: 'rps',
                              data: r.levels.map((l) => ({ x: levelX(r, l), y: num(l.rps) })) });
        }
        const grid = el('div', { class: 'grid' });
        parent.append(grid);
        plot(grid, 'latency percentiles of ok replies (ms)', {
            type: 'line', data: { datasets: latency },
            options: { scales: { x: levelAxis(group, xTitle),
                                 y: { beginAtZero: true, title: { display: true, text: 'ms' } } } } });
        plot(grid, 'throughput', {
            type: 'line', data: { datasets: throughput },
            options: { scales: { x: levelAxis(group, xTitle),
                                 y: { beginAtZero: true, title: { display: true, text: 'tokens/s' } },
                                 rps: { position: 'right', beginAtZero: true,
                                        grid: { drawOnChartArea: false },
                                        title: { display: true, text: 'requests/s (dashed)' } } } } });
    }

    /* Per level of one run: the mean latency split into its parts, and the merged batch. */
    function spans(parent, r) {
        const levels = r.levels.filter((l) => num(l.ok) > 0);
        const part = (l, k) => {
            const q = num(l.server.queue_ms.mean), c = num(l.server.compute_ms.mean);
            return k === 'queue' ? q : k === 'compute' ? c : Math.max(0, num(l.latency_ms.mean) - q - c);
        };
        const datasets = PARTS.map(([k, label, color]) => ({
            type: 'bar', label, backgroundColor: color, stack: 'latency', yAxisID: 'y',
            data: levels.map((l) => part(l, k)) }));
        datasets.push({ type: 'line', label: 'requests merged per launch (mean)', yAxisID: 'batch',
                        borderColor: '#1d2330', backgroundColor: '#1d2330',
                        data: levels.map((l) => num(l.server.batch_requests_mean)) });
        plot(parent, r.name + ': where the mean latency goes', {
            type: 'bar',
            data: { labels: levels.map((l) => levelName(r, l)), datasets },
            options: { scales: { x: { stacked: true },
                                 y: { stacked: true, beginAtZero: true,
                                      title: { display: true, text: 'ms (mean)' } },
                                 batch: { position: 'right', beginAtZero: true,
                                          grid: { drawOnChartArea: false },
                                          title: { display: true, text: 'requests per launch' } } } } });
    }

    /* Tokens per (layer, expert) over the run, warm-ups included: as the daemons counted them
     * (--metrics) when the run has that, else from the routes moed-load sent. */
    function expertTable(r) {
        for (const source of ['servers', 'sent']) {
            const sum = {};
            let any = false;
            for (const l of r.levels) {
                const by = (l.expert_tokens || {})[source];
                if (!by) continue;
                for (const [layer, counts] of Object.entries(by)) {
                    const row = sum[layer] || (sum[layer] = []);
                    counts.forEach((v, e) => { row[e] = num(row[e]) + num(v); any = any || v > 0; });
                }
            }
            if (any) return { source, sum };
        }
        return null;
    }

    function heatmap(parent, r) {
        const t = expertTable(r);
        const box = el('div', { class: 'heatmap', 'data-run': r.name });
        parent.append(box);
        box.append(el('h3', {}, r.name));
        if (!t) {
            box.append(el('p', { class: 'note' }, 'no tokens per expert: the server routed and ' +
                              'no --metrics endpoint was read'));
            return;
        }
        const layers = Object.keys(t.sum).sort((a, b) => a - b);
        const experts = Math.max(...layers.map((l) => t.sum[l].length));
        const max = Math.max(1, ...layers.flatMap((l) => t.sum[l].map(num)));
        const cw = Math.max(3, Math.min(28, Math.floor(1000 / experts))), ch = Math.max(10, Math.min(24, cw));
        const left = 64, top = 18;
        const s = svg('svg', { width: left + experts * cw + 8, height: top + layers.length * ch + 4,
                               role: 'img', 'aria-label': 'tokens per expert, ' + r.name });
        const step = Math.max(1, Math.ceil(36 / cw)); /* a label every 36 px or so */
        for (let e = 0; e < experts; e += step) {
            const label = svg('text', { x: left + e * cw + cw / 2, y: 12, 'text-anchor': 'middle' });
            label.textContent = e;
            s.append(label);
        }
        layers.forEach((layer, i) => {
            const row = t.sum[layer];
            const mean = row.reduce((a, v) => a + num(v), 0) / (row.length || 1);
            const label = svg('text', { x: 0, y: top + i * ch + ch / 2 + 4 });
            label.textContent = 'layer ' + layer;
            s.append(label);
            for (let e = 0; e < experts; e++) {
                const v = num(row[e]);
                /* white to dark blue as the count goes from 0 to the busiest cell's */
                const f = Math.sqrt(v / max);
                const fill = 'rgb(' + [247 - 239 * f, 251 - 203 * f, 255 - 148 * f].map(Math.round) + ')';
                const cell = svg('rect', { x: left + e * cw, y: top + i * ch, width: cw - (cw > 4),
                                           height: ch - 1, fill, class: 'cell', 'data-layer': layer,
                                           'data-expert': e, 'data-tokens': v });
                const tip = svg('title');
                tip.textContent = 'layer ' + layer + ', expert ' + e + ': ' + fmt(v, 0) + ' tokens (' +
                    fmt(mean ? v / mean : 0, 2) + 'x the layer\'s mean)';
                cell.append(tip);
                s.append(cell);
            }
        });
        box.append(s);
        const notes = layers.map((layer) => {
            const row = t.sum[layer].map(num);
            const mean = row.reduce((a, v) => a + v, 0) / (row.length || 1);
            const hi = row.indexOf(Math.max(...row));
            return 'layer ' + layer + ': busiest expert ' + hi + ' at ' +
                fmt(mean ? row[hi] / mean : 0, 2) + 'x the mean';
        });
        box.append(el('p', { class: 'note' }, (t.source === 'servers'
            ? 'as the daemons counted them (moed_expert_tokens_total, --metrics)'
            : 'from the routes moed-load sent') + ', over every level with its warm-up. ' +
            notes.join('; ') + '.'));
    }

    function levelsTable(parent, group) {
        const table = el('table', { class: 'levels' });
        const head = ['run', 'level', 'requests', 'ok', 'errors', 'req/s', 'tokens/s', 'p50 ms',
                      'p99 ms', 'queue ms', 'compute ms', 'merged'];
        table.append(el('tr', {}, ...head.map((h) => el('th', {}, h))));
        for (const r of group)
            for (const l of r.levels)
                table.append(el('tr', {}, el('td', {}, r.name), el('td', {}, levelName(r, l)),
                    ...[l.requests, l.ok, l.errors_total].map((v) => el('td', { class: 'num' }, fmt(v, 0))),
                    ...[[l.rps, 1], [l.tokens_per_s, 0], [l.latency_ms.p50, 3], [l.latency_ms.p99, 3],
                        [l.server.queue_ms.mean, 3], [l.server.compute_ms.mean, 3],
                        [l.server.batch_requests_mean, 2]]
                        .map(([v, d]) => el('td', { class: 'num' }, fmt(v, d)))));
        parent.append(table);
    }

    header();
    for (const [closed, title, xTitle] of [[true, 'Closed loop', 'calls in flight (concurrency)'],
                                           [false, 'Open loop', 'requests/s asked']]) {
        const group = runs.filter((r) => closedLoop(r) === closed);
        if (!group.length) continue;
        const section = el('section', { class: closed ? 'closed' : 'open' });
        root.append(section);
        section.append(el('h2', {}, title + ': latency and throughput against ' + xTitle));
        versusLevel(section, group, xTitle);
        section.append(el('h2', {}, title + ': the server\'s queue and compute, per level'));
        const grid = el('div', { class: 'grid' });
        section.append(grid);
        group.forEach((r) => spans(grid, r));
        levelsTable(section, group);
    }
    root.append(el('h2', {}, 'Tokens per expert'));
    runs.forEach((r) => heatmap(root, r));
    for (const [canvas, config] of pending) new Chart(canvas, config);
})();
