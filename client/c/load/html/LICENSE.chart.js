chart.min.js is Chart.js 3.9.1 (https://www.chartjs.org), with @kurkle/color 0.2.1 built in, as
Debian 12 ships it: package libjs-chart.js 3.9.1+~0.2.1-2, file
/usr/share/javascript/chart.js/chart.min.js, unchanged (sha256
fbc45926e6b46845a0f905552a0e0b1331049bff1115ecf94dbe0904d895e710). Both are under the MIT License:

The MIT License (MIT)

Copyright (c) 2014-2022 Chart.js Contributors
Copyright (c) 2022 Jukka Kurkela (@kurkle/color)

Permission is hereby granted, free of charge, to any person obtaining a copy of this software and
associated documentation files (the "Software"), to deal in the Software without restriction,
including without limitation the rights to use, copy, modify, merge, publish, distribute,
sublicense, and/or sell copies of the Software, and to permit persons to whom the Software is
furnished to do so, subject to the following conditions:

The above copyright notice and this permission notice shall be included in all copies or
substantial portions of the Software.

THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR IMPLIED, INCLUDING BUT
NOT LIMITED TO THE WARRANTIES OF MERCHANTABILITY, FITNESS FOR A PARTICULAR PURPOSE AND
NONINFRINGEMENT. IN NO EVENT SHALL THE AUTHORS OR COPYRIGHT HOLDERS BE LIABLE FOR ANY CLAIM,
DAMAGES OR OTHER LIABILITY, WHETHER IN AN ACTION OF CONTRACT, TORT OR OTHERWISE, ARISING FROM, OUT
OF OR IN CONNECTION WITH THE SOFTWARE OR THE USE OR OTHER DEALINGS IN THE SOFTWARE.
