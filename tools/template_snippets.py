"""Small Jinja snippets exercising each statement, filter, test, method and value form.
Imported by tools/gen_template_refs.py, which renders them with jinja2 (HF settings) into
tests/fixtures/template/snippets.json for tests/test_template_jinja.c."""

V = {
    "s": "Hello, World", "u": "héllo wörld ☃ 🎉", "n": 42, "f": 2.5, "neg": -7, "t": True, "no": None,
    "xs": [3, 1, 2], "names": ["bob", "Alice", "carol"], "d": {"b": 1, "a": [1, 2], "c": {"x": None}},
    "msgs": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo", "x": 1},
             {"role": "user", "content": "bye"}],
    "big": 12345678901234, "tiny": 1e-7, "huge": 1e22, "whole": 3.0, "e": "", "ws": "  \t padded \n ",
}

S = [
    # output and literals
    "{{ 1 }}|{{ 1.5 }}|{{ 'a' }}|{{ \"b\" }}|{{ true }}|{{ false }}|{{ none }}|{{ True }}|{{ None }}",
    "{{ [1, 'a', none, true, 2.0] }}", "{{ (1, 2) }}|{{ (1,) }}|{{ () }}", "{{ {'a': 1, 'b': [none]} }}",
    "{{ d }}", "{{ msgs[1] }}", "{{ xs }}|{{ names }}", "{{ f }}|{{ whole }}|{{ tiny }}|{{ huge }}|{{ big }}",
    "{{ 0.1 + 0.2 }}|{{ 1/3 }}|{{ 2 ** 0.5 }}|{{ 10 / 4 }}|{{ 1e16 }}|{{ 123456789.123 }}|{{ -0.0 }}",
    "{{ \"it's\" }}|{{ ['it\\'s', 'say \"x\"', 'both \\' \"'] }}", "{{ ['tab\\there', 'nl\\n', 'bs\\\\', '\\x01', 'é☃'] }}",
    "{{ 'a' 'b' }}", "{{ '\\u2603\\x41\\101\\q\\U0001F389' }}",
    # arithmetic and operators
    "{{ 7 // 2 }}|{{ -7 // 2 }}|{{ 7 % 3 }}|{{ -7 % 3 }}|{{ 7 % -3 }}|{{ 2 ** 10 }}|{{ 2 ** -1 }}|{{ 7.5 // 2 }}|{{ -7.5 % 2 }}",
    "{{ 1 + 2 * 3 - 4 / 2 }}|{{ (1 + 2) * 3 }}|{{ -n }}|{{ +n }}|{{ - -1 }}|{{ true + 1 }}",
    "{{ 'ab' * 3 }}|{{ 3 * 'x' }}|{{ [1] * 2 }}|{{ [1] + [2] }}|{{ 'a' ~ 1 ~ none ~ [1] }}",
    "{{ 1 < 2 < 3 }}|{{ 3 > 2 > 2 }}|{{ 'a' < 'b' }}|{{ [1, 2] < [1, 3] }}|{{ 1 == 1.0 }}|{{ 1 != '1' }}|{{ true == 1 }}",
    "{{ 'a' in 'cat' }}|{{ 2 in xs }}|{{ 'a' in d }}|{{ 5 not in xs }}|{{ 'z' not in 'abc' }}",
    "{{ n and s }}|{{ 0 and s }}|{{ e or 'default' }}|{{ not n }}|{{ not e }}|{{ none or false }}",
    "{{ 'yes' if n > 10 else 'no' }}|{{ 'yes' if e }}|{{ 'a' if false else 'b' if false else 'c' }}",
    # subscripts, attributes, slicing
    "{{ xs[0] }}|{{ xs[-1] }}|{{ xs[5] }}|{{ d['a'][1] }}|{{ d.a.1 }}|{{ d.c.x }}|{{ msgs[0].role }}|{{ d.zz }}",
    "{{ xs[1:] }}|{{ xs[:1] }}|{{ xs[::-1] }}|{{ xs[::2] }}|{{ xs[-2:] }}|{{ xs[5:] }}|{{ xs[1:-1] }}|{{ xs[:-5] }}",
    "{{ u[::-1] }}|{{ u[1:4] }}|{{ u[-2] }}|{{ s[::3] }}|{{ u[:-1] }}|{{ s[10:2:-2] }}",
    "{{ msgs[::-1] | map(attribute='role') | list }}",
    # if / for / loop / set / namespace
    "{% if n > 40 %}big{% elif n > 10 %}mid{% else %}small{% endif %}",
    "{% if no %}a{% elif e %}b{% endif %}|",
    "{% for x in xs %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.revindex0 }}{{ loop.first }}{{ loop.last }}{{ loop.length }};{% endfor %}",
    "{% for x in xs %}{{ loop.previtem }}-{{ loop.nextitem }}-{{ loop.cycle('a', 'b') }};{% endfor %}",
    "{% for x in [] %}x{% else %}empty{% endfor %}", "{% for m in msgs %}{% if loop.changed(m.role) %}[{{ m.role }}]{% endif %}{% endfor %}{% for x in [1, 1, 2, 1] %}{{ loop.changed(x) }}{% endfor %}", "{% for x in xs if x > 1 %}{{ x }}{{ loop.index }}{{ loop.last }}{% endfor %}",
    "{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}", "{% for k in d %}{{ k }}{% endfor %}",
    "{% for c in 'héé' %}[{{ c }}]{% endfor %}", "{% for a, b in [(1, 2), (3, 4)] %}{{ a + b }}{% endfor %}",
    "{% for x in xs %}{% if x == 1 %}{% continue %}{% endif %}{% if x == 2 %}{% break %}{% endif %}{{ x }}{% endfor %}",
    "{% for x in xs %}{% for y in xs %}{{ loop.index }}{% endfor %}/{{ loop.index }} {% endfor %}",
    "{% set a = 1 %}{% for x in xs %}{% set a = a + x %}{{ a }}{% endfor %}|{{ a }}",
    "{% set ns = namespace(total=0, items=[]) %}{% for x in xs %}{% set ns.total = ns.total + x %}{% set ns.items = ns.items + [x] %}{% endfor %}{{ ns.total }}{{ ns.items }}",
    "{% set a, b = 1, 2 %}{{ a }}{{ b }}{% set c = (3, 4) %}{{ c }}",
    "{% set x %}inner {{ n }}{% endset %}[{{ x }}]", "{% set x | upper %}shout{% endset %}{{ x }}",
    "{% set ns = namespace(a=1) %}{{ ns.a }}{{ ns.b }}|{{ ns }}",
    "{% with a = 5, b = 6 %}{{ a * b }}{% endwith %}{{ a }}",
    "{% filter upper %}abc {{ s }}{% endfilter %}",
    "{% raw %}{{ not evaluated }} {% if %}{% endraw %}",
    "{% for m in msgs %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}{% else %}[{{ m.content }}]{% endif %}{% endfor %}",
    "{# comment #}a{# another\n multi-line #}b",
    # macros and call
    "{% macro greet(name, greeting='Hello') %}{{ greeting }}, {{ name }}!{% endmacro %}{{ greet('Bob') }} {{ greet('Al', greeting='Hi') }} {{ greet(name='Z') }}",
    "{% macro m(a) %}{{ a }}{{ varargs }}{{ kwargs }}{% endmacro %}{{ m(1, 2, 3, k=4) }}",
    "{% macro wrap() %}<{{ caller() }}>{% endmacro %}{% call wrap() %}inside {{ n }}{% endcall %}",
    "{% macro lst(items) %}{% for i in items %}{{ caller(i) }}{% endfor %}{% endmacro %}{% call(x) lst(xs) %}[{{ x }}]{% endcall %}",
    "{% macro fact(k) %}{% if k <= 1 %}1{% else %}{{ k * fact(k - 1) | int }}{% endif %}{% endmacro %}{{ fact(5) }}",
    # whitespace control
    "a  {%- if true -%}  b  {%- endif -%}  c", "  {% if true %}\n  x\n  {% endif %}\n  y",
    "{{- ' a ' -}}  \n  {{ 'b' }}", "line1\n    {% for x in xs %}\n    {{ x }}\n    {% endfor %}\nend",
    "{%+ if true %} keep{% endif %}", "  {%+ if true %}x{% endif +%}\ny", "a\n{# c #}\nb", "  {#- c -#}  x",
    "x {{ 'y' }}\n{% if true %}z{% endif %}\n", "{% if true %}\n\n{% endif %}\n",
    # filters
    "{{ ws | trim }}|{{ 'xxhixx' | trim('x') }}|{{ u | length }}|{{ xs | count }}|{{ d | length }}|{{ undefined_var | length }}",
    "{{ d | tojson }}|{{ msgs | tojson }}|{{ 'é☃\"\\n\\t\\u0001' | tojson }}|{{ [1.0, 2.5e-10, 1e100, none, true] | tojson }}",
    "{{ d | tojson(indent=2) }}", "{{ msgs[1] | tojson(indent=4) }}", "{{ {'b': 1, 'a': 2} | tojson(sort_keys=true) }}",
    "{{ 'é' | tojson(ensure_ascii=true) }}|{{ '🎉' | tojson(true) }}", "{{ d | tojson(separators=(',', ':')) }}",
    "{{ {1: 'a', true: 'b', none: 'c', 2.5: 'd'} | tojson }}", "{{ [[], {}, [[]]] | tojson(indent=2) }}",
    "{{ names | join(', ') }}|{{ xs | join }}|{{ msgs | join('-', attribute='role') }}|{{ [1, none] | join('/') }}",
    "{{ undefined_var | default('dflt') }}|{{ e | default('dflt') }}|{{ e | default('dflt', true) }}|{{ no | d('x') }}",
    "{{ s | upper }}|{{ s | lower }}|{{ 'hello WORLD' | capitalize }}|{{ 'hello big-world (x) o\\'neil' | title }}",
    "{{ d | items | list }}|{{ xs | list }}|{{ 'ab' | list }}|{{ d | list }}",
    "{{ names | map('upper') | list }}|{{ msgs | map(attribute='role') | join(',') }}|{{ msgs | map(attribute='x', default=0) | list }}",
    "{{ xs | select('odd') | list }}|{{ xs | reject('odd') | list }}|{{ [0, 1, '', 'a'] | select | list }}|{{ xs | select('gt', 1) | list }}",
    "{{ msgs | selectattr('role', 'equalto', 'user') | map(attribute='content') | join }}|{{ msgs | rejectattr('role', 'eq', 'user') | list | length }}|{{ msgs | selectattr('x') | list | length }}|{{ msgs | selectattr('x', 'defined') | list | length }}",
    "{{ xs | first }}|{{ xs | last }}|{{ 'abc' | first }}|{{ [] | first }}|{{ s | last }}",
    "{{ n | string }}|{{ xs | string }}|{{ '42' | int }}|{{ '4.7' | int }}|{{ 'x' | int }}|{{ 'x' | int(7) }}|{{ 3.9 | int }}|{{ '0x1A' | int(0, 16) }}",
    "{{ '2.5' | float }}|{{ 'x' | float }}|{{ 3 | float }}|{{ none | float }}",
    "{{ s | replace('o', '0') }}|{{ s | replace('l', 'L', 2) }}|{{ 'aaa' | replace('', '-') }}|{{ s | safe }}",
    "{{ neg | abs }}|{{ -2.5 | abs }}|{{ 2.567 | round }}|{{ 2.567 | round(2) }}|{{ 2.5 | round }}|{{ 2.1 | round(0, 'ceil') }}",
    "{{ xs | sort }}|{{ names | sort }}|{{ names | sort(reverse=true) }}|{{ names | sort(case_sensitive=true) }}|{{ msgs | sort(attribute='content') | map(attribute='content') | join }}",
    "{{ [1, 2, 1, 3] | unique | list }}|{{ ['a', 'A', 'b'] | unique | list }}|{{ xs | min }}|{{ xs | max }}|{{ xs | sum }}|{{ msgs | selectattr('x', 'defined') | sum(attribute='x') }}",
    "{{ d | dictsort }}|{{ xs | reverse | list }}|{{ s | reverse }}|{{ '<a href=\"x\">&</a>' | e }}",
    "{{ 'a\\nb\\n\\nc' | indent }}|{{ 'a\\nb' | indent(2, true) }}|{{ 'a\\n\\nb' | indent('> ', blank=true) }}",
    "{{ 'one two  three' | wordcount }}|{{ d | attr('a') }}",
    # tests
    "{{ n is defined }}{{ zz is defined }}{{ zz is undefined }}{{ no is none }}{{ s is string }}{{ n is string }}",
    "{{ d is mapping }}{{ xs is mapping }}{{ xs is iterable }}{{ n is iterable }}{{ s is iterable }}{{ xs is sequence }}",
    "{{ n is number }}{{ f is number }}{{ t is number }}{{ s is number }}{{ n is integer }}{{ f is float }}{{ t is boolean }}",
    "{{ t is true }}{{ 1 is true }}{{ false is false }}{{ 0 is false }}{{ n is equalto 42 }}{{ n is eq(42) }}{{ n is ne 1 }}",
    "{{ n is gt 1 }}{{ n is lt 1 }}{{ n is ge 42 }}{{ n is le 41 }}{{ 2 is in xs }}{{ 3 is odd }}{{ 4 is even }}{{ 9 is divisibleby 3 }}",
    "{{ 'abc' is lower }}{{ 'ABC' is upper }}{{ n is not none }}{{ none is sameas none }}{{ greet is defined }}",
    # string methods
    "{{ ws.strip() }}|{{ ws.lstrip() }}|{{ ws.rstrip() }}|{{ 'xxaxx'.strip('x') }}|{{ '\\n\\nhi\\n'.lstrip('\\n') }}|{{ u.strip('h🎉') }}",
    "{{ s.startswith('Hell') }}{{ s.endswith('ld') }}{{ s.startswith(('x', 'He')) }}{{ s.endswith('x') }}",
    "{{ s.split(', ') }}|{{ ' a  b c '.split() }}|{{ 'a,b,c'.split(',', 1) }}|{{ 'a,b,c'.rsplit(',', 1) }}|{{ ' a b '.split(none, 1) }}|{{ ''.split(',') }}|{{ ''.split() }}",
    "{{ s.replace('l', 'L') }}|{{ s.upper() }}|{{ s.lower() }}|{{ 'hello wORLD 3rd x-y'.title() }}|{{ 'hELLO'.capitalize() }}|{{ u.upper() }}",
    "{{ s.find('o') }}|{{ s.rfind('o') }}|{{ u.find('ö') }}|{{ s.find('z') }}|{{ s.count('l') }}|{{ '-'.join(names) }}|{{ s.index('W') }}",
    "{{ 'abc'.isalpha() }}{{ '123'.isdigit() }}{{ ' '.isspace() }}{{ 'ab1'.isalnum() }}{{ 'AB'.isupper() }}{{ 'ab'.islower() }}",
    "{{ 'a\\nb\\r\\nc'.splitlines() }}|{{ 'ab'.center(6, '*') }}|{{ 'ab'.ljust(4) }}|{{ 'ab'.rjust(4, '.') }}|{{ '7'.zfill(3) }}",
    "{{ 'k=v=w'.partition('=') }}|{{ 'k=v=w'.rpartition('=') }}|{{ 'prefix_x'.removeprefix('prefix_') }}",
    "{{ d.get('a') }}|{{ d.get('zz') }}|{{ d.get('zz', 5) }}|{{ d.keys() | list }}|{{ d.values() | list }}|{{ xs.index(2) }}|{{ xs.count(3) }}",
    "{{ msgs[0]['role'] }}|{{ msgs[0].get('content') }}|{{ d['items'] is defined }}",
    # printf-style formatting
    "{{ '%s and %s' % (n, s) }}|{{ '%d|%5d|%-5d|%05d|%+d' % (n, n, n, n, n) }}|{{ '%.2f|%8.3f|%e|%g' % (f, f, big, tiny) }}|{{ '%x %X %o' % (255, 255, 8) }}",
    "{{ '%s' % xs }}|{{ '%s' % d }}|{{ '%(b)s-%(a)s' % d }}|{{ '%r' % s }}|{{ '%c%c' % (65, 'é') }}|{{ '100%%' % () }}|{{ '%s' % zz }}|{{ '%.3s|%5s|%-5s|' % (u, 'ab', 'ab') }}",
    "{{ '%s %s' % (1,) }}", "{{ '%s' % (1, 2) }}", "{{ '%d' % 'x' }}",
    # generator / iterator / view semantics (always truthy, consumed once, no len, not subscriptable)
    "{% if [] | select %}T{% endif %}|{% if [] | map('upper') %}T{% endif %}|{% if xs | reverse %}T{% endif %}|{% if {} | items %}T{% endif %}|{% if {}.items() %}T{% else %}F{% endif %}|{% if msgs | selectattr('role', 'equalto', 'system') %}T{% endif %}",
    "{% set g = xs | select %}{% for a in g %}{{ a }}{% endfor %}/{% for a in g %}{{ a }}{% endfor %}|{% set h = xs | reject('odd') %}{{ h | first }}{{ h | list }}|{% set r = xs | reverse %}{{ r | first }}{{ r | list }}{{ r | list }}",
    "{{ (xs | select)[0] }}|{{ (xs | reverse)[0] }}|{{ d.items()[0] }}|{{ d.items() }}|{{ d.keys() }}|{{ d.values() | list }}|{{ d.items() | length }}|{{ ('a', [1, 2]) in d.items() }}|{{ 'b' in d.keys() }}",
    "{{ xs | select == xs }}|{{ d.keys() == ['b', 'a', 'c'] }}|{{ xs | select is sequence }}|{{ d.keys() is sequence }}|{{ xs | select is iterable }}|{% set g = xs | select %}{{ 3 in g }}{{ g | list }}",
    "{{ xs | select | length }}", "{{ xs | select | tojson }}", "{{ xs | select | last }}", "{{ xs | reverse | last }}",
    "{{ d.items() | tojson }}", "{{ xs | select + [1] }}",
    # globals
    "{{ range(3) | list }}|{{ range(1, 10, 3) | list }}|{{ range(5, 0, -2) | list }}|{% for i in range(2) %}{{ i }}{% endfor %}",
    "{{ dict(a=1, b='x') }}|{{ namespace(a=1).a }}",
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}",
    # errors
    "{{ zz.attr }}", "{{ d.zz.attr }}", "{{ 1 + 'a' }}", "{{ 'a' + 1 }}", "{{ zz + 1 }}", "{{ 1 / 0 }}", "{{ 1 // 0 }}",
    "{{ n | tojson(indent='x') }}", "{{ zz | tojson }}", "{{ xs < 'a' }}", "{{ none | length }}", "{% for x in n %}{% endfor %}",
    "{{ xs.append(4) }}", "{{ d.update({}) }}", "{{ range(1000000) | length }}", "{{ ''.split('') }}", "{{ xs[::0] }}",
    "{% set ns = namespace() %}{% set ns._x = 1 %}", "{{ 1 in n }}", "{{ zz() }}", "{{ s() }}", "{% set a, b = [1] %}",
]

def snippet_cases():
    return [{"template": t, "vars": V} for t in S]
