"""Every malformed spec gets the exact diagnostic: ``file:line:col: error: msg``, the source
line, a caret under the offending text, then notes.  One table row per mistake; the CLI side
(exit status 2, no traceback) is in test_cli_spec.py."""

from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple

import pytest

from purlinc.errors import PurlinError, Source, Span
from purlinc.frontend.check import check
from purlinc.frontend.parse import parse, parse_file, read_source


class Case(NamedTuple):
    name: str
    source: str
    expected: tuple[str, ...]  # the rendered lines
    R: int = 4
    params: dict | None = None


def diagnose(source: str, world_size: int, params: dict | None = None, filename: str = "spec.pln") -> PurlinError:
    with pytest.raises(PurlinError) as info:
        check(parse(source, filename), world_size, params)
    return info.value


CASES = [
    Case(
        'missing_bracket',  # reported at the next line's 'out' before, where the '[' was left open
        'collective a {\n    in[r] = x[r\n    out[r] = x[0..R]\n    copy\n}\n',
        (
            "spec.pln:2:16: error: the '[' at 2:14 is not closed at the end of the line; expected '..', ']'",
            '        in[r] = x[r',
            '                   ^',
            "note: a ']' goes here, or the line goes on",
        ),
        R=4,
    ),
    Case(
        'missing_operation',
        'collective a {\n    in[r] = x[r]\n    out[r] = x[0..R]\n}\n',
        (
            "spec.pln:4:1: error: missing the operation: a collective ends with 'copy' or 'reduce'",
            '    }',
            '    ^',
        ),
        R=4,
    ),
    Case(
        'unexpected_eof',
        'collective a {\n    in[r] = x[r]\n    out[r] = x[0..R]\n    copy\n',
        (
            "spec.pln:4:9: error: the '{' at 1:14 is not closed at the end of the file; expected ';', 'epilogue', "
            "'replicated', '}'",
            '        copy',
            '            ^',
            "note: a '}' goes here",
        ),
        R=4,
    ),
    Case(
        'body_not_closed_before_the_next_collective',  # the parser stops at 'collective', the '}' is missing above
        'collective a {\n    in[r] = x[r]\n    out[r] = x[0..R]\n    copy\n\ncollective b { in[r] = y[r] out[r] = y[0..R] copy }\n',
        (
            "spec.pln:4:9: error: the '{' at 1:14 is not closed before the next collective (at 6:1); expected ';', "
            "'epilogue', 'replicated', '}'",
            '        copy',
            '            ^',
            "note: a '}' goes here",
        ),
        R=4,
    ),
    Case(
        'bad_character',
        'collective a {\n    in[r] = x[r] $\n}\n',
        (
            "spec.pln:2:18: error: unexpected character '$'",
            '        in[r] = x[r] $',
            '                     ^',
        ),
        R=4,
    ),
    Case(
        'missing_name',
        'collective {\n    in[r] = x[r]\n}\n',
        (
            "spec.pln:1:12: error: unexpected '{'; expected 'copy', 'reduce', a name",
            '    collective {',
            '               ^',
        ),
        R=4,
    ),
    Case(
        'two_collectives',
        'collective a { in[r] = x out[0] = x reduce }\ncollective b { in[r] = x out[0] = x reduce }\n',
        (
            "spec.pln:2:1: error: unexpected keyword 'collective'; expected the end of the file",
            '    collective b { in[r] = x out[0] = x reduce }',
            '    ^^^^^^^^^^',
        ),
        R=4,
    ),
    Case(
        'double_equals',
        'collective a {\n    in[r] == x[r]\n    out[r] = x[0..R]\n    copy\n}\n',
        (
            "spec.pln:2:11: error: unexpected '=='; expected '='",
            '        in[r] == x[r]',
            '              ^^',
        ),
        R=4,
    ),
    Case(
        'keyword_as_chunk',
        'collective a {\n    in[r] = copy[r]\n    out[r] = x[0..R]\n    copy\n}\n',
        (
            "spec.pln:2:13: error: unexpected keyword 'copy'; expected a name",
            '        in[r] = copy[r]',
            '                ^^^^',
        ),
        R=4,
    ),
    Case(
        'unterminated_comment',
        'collective a {\n    in[r] = x[r]\n    /* out[r] = x[r]\n    copy\n}\n',
        (
            "spec.pln:3:5: error: unterminated comment: '/*' has no matching '*/'",
            '        /* out[r] = x[r]',
            '        ^^',
        ),
        R=4,
    ),
    Case(  # after an operand the '/' is a division: the error landed on the '*' ("unexpected '*'")
        'unterminated_comment_after_an_operand',
        'collective a {\n    in[r] = x[r /* never closed\n]\n    out[r] = x[0..R]\n    copy\n}\n',
        (
            "spec.pln:2:17: error: unterminated comment: '/*' has no matching '*/'",
            '        in[r] = x[r /* never closed',
            '                    ^^',
        ),
        R=4,
    ),
    Case(
        'reduce_op_as_operation',
        'collective a {\n    in[r] = x[0..R]\n    out[r] = x[0..R]\n    sum\n}\n',
        (
            "spec.pln:4:5: error: 'sum' is not an operation: a collective ends with 'copy' or 'reduce'",
            '        sum',
            '        ^^^',
            "note: the reduction operator (sum, prod, max, min) is chosen at call time; write 'reduce'",
        ),
        R=4,
    ),
    Case(
        'unknown_name',
        'collective a {\n    in[r] = x[r]\n    out[r] = x[0..N]\n    copy\n}\n',
        (
            "spec.pln:3:19: error: unknown name 'N'",
            '        out[r] = x[0..N]',
            '                      ^',
            'note: names defined here: R (world size), r (rank)',
            'note: while checking a for R=4',
        ),
        R=4,
    ),
    Case(
        'rank_outside_every_rank',
        'collective a(root = 0) {\n    in[root] = x[r]\n    out[r] = x[0]\n    copy\n}\n',
        (
            "spec.pln:2:18: error: 'r' (the rank) is only defined on the right-hand side of a statement for every rank, such as 'out[r] = ...'",
            '        in[root] = x[r]',
            '                     ^',
            'note: while checking a for R=4',
        ),
        R=4,
    ),
    Case(
        'unbound_parameter',
        'collective a(root) {\n    in[root] = x\n    out[r] = x\n    copy\n}\n',
        (
            "spec.pln:1:14: error: parameter 'root' is not bound",
            '    collective a(root) {',
            '                 ^^^^',
            'note: give it a value (purlinc --param root=N, or root=N in Python), or a default in the declaration: (root = 0)',
            'note: while checking a for R=4',
        ),
        R=4,
    ),
    Case(
        'unknown_parameter',
        'collective a(root = 0) {\n    in[root] = x\n    out[r] = x\n    copy\n}\n',
        (
            "spec.pln:1:1: error: a has no parameter 'rot' (its parameters: root)",
            '    collective a(root = 0) {',
            '    ^',
            'note: while checking a for R=4, rot=1',
        ),
        R=4, params={'rot': 1},
    ),
    Case(
        'duplicate_parameter',
        'collective a(k, k) {\n    in[r] = x[r]\n    out[r] = x[r]\n    copy\n}\n',
        (
            "spec.pln:1:17: error: parameter 'k' is declared twice",
            '    collective a(k, k) {',
            '                    ^',
            'note: while checking a for R=4',
        ),
        R=4,
    ),
    Case(
        'reserved_parameter',
        'collective a(R = 1) {\n    in[r] = x[r]\n    out[r] = x[r]\n    copy\n}\n',
        (
            "spec.pln:1:14: error: 'R' is reserved and cannot be a parameter name",
            '    collective a(R = 1) {',
            '                 ^^^^^',
            'note: while checking a for R=4',
        ),
        R=4,
    ),
    Case(
        'no_producer',
        'collective a {\n    in[r] = x[r]\n    out[r] = y[r]\n    copy\n}\n',
        (
            'spec.pln:3:14: error: output chunk y[0] of rank 0 has no producer: no input names it',
            '        out[r] = y[r]',
            '                 ^^^^',
            "note: no input names any chunk called 'y'",
            'note: while checking a for R=4',
        ),
        R=4,
    ),
    Case(
        'range_past_inputs',
        'collective a {\n    in[r] = x[r]\n    out[r] = x[0..R+1]\n    copy\n}\n',
        (
            'spec.pln:3:14: error: output chunk x[4] of rank 0 has no producer: no input names it',
            '        out[r] = x[0..R+1]',
            '                 ^^^^^^^^^',
            "note: the inputs name 4 chunks called 'x': x[0], x[1], x[2], x[3]",
            'note: while checking a for R=4',
        ),
        R=4,
    ),
    Case(
        'index_past_inputs_for_some_r',
        'collective a {\n    in[r] = x[r]\n    out[r] = x[r + 1]\n    copy\n}\n',
        (
            'spec.pln:3:14: error: output chunk x[4] of rank 3 has no producer: no input names it',
            '        out[r] = x[r + 1]',
            '                 ^^^^^^^^',
            "note: the inputs name 4 chunks called 'x': x[0], x[1], x[2], x[3]",
            'note: while checking a for R=4',
        ),
        R=4,
    ),
    Case(
        'conflicting_producers',
        'collective a {\n    in[r] = x\n    out[r] = x\n    copy\n}\n',
        (
            "spec.pln:2:13: error: conflicting producers under 'copy': x is given by rank 0 (in[0]) and by rank 1 (in[0])",
            '        in[r] = x',
            '                ^',
            "note: under 'copy' a chunk has exactly one producer; write 'copy replicated' if these inputs hold identical data",
            'note: while checking a for R=4',
        ),
        R=4,
    ),
    Case(
        'empty_range',
        'collective a {\n    in[r] = x[r]\n    out[r] = x[1..R]\n    copy\n}\n',
        (
            'spec.pln:3:16: error: range 1..R is empty (1..1)',
            '        out[r] = x[1..R]',
            '                   ^^^^',
            'note: while checking a for R=1',
        ),
        R=1,
    ),
    Case(
        'reversed_range',
        'collective a {\n    in[r] = x[r]\n    out[r] = x[R..0]\n    copy\n}\n',
        (
            'spec.pln:3:16: error: range R..0 is empty (4..0)',
            '        out[r] = x[R..0]',
            '                   ^^^^',
            'note: while checking a for R=4',
        ),
        R=4,
    ),
    Case(
        'negative_range',
        'collective a {\n    in[r] = x[r]\n    out[r] = x[-1..R]\n    copy\n}\n',
        (
            'spec.pln:3:16: error: range -1..R starts at -1, below 0 (chunk indices start at 0)',
            '        out[r] = x[-1..R]',
            '                   ^^^^^',
            'note: while checking a for R=4',
        ),
        R=4,
    ),
    Case(
        'negative_index',
        'collective a {\n    in[r] = x[r]\n    out[r] = x[r - 1]\n    copy\n}\n',
        (
            "spec.pln:3:16: error: index 'r - 1' is -1, out of bounds (chunk indices start at 0)",
            '        out[r] = x[r - 1]',
            '                   ^^^^^',
            'note: at r=0',
            'note: while checking a for R=4',
        ),
        R=4,
    ),
    Case(
        'rank_index_out_of_range',
        'collective a(root = 4) {\n    in[root] = x\n    out[r] = x\n    copy\n}\n',
        (
            "spec.pln:2:8: error: rank index 'root' is 4, outside 0..3",
            '        in[root] = x',
            '           ^^^^',
            'note: with root=4 (its default)',  # the value came from the default: said so
            'note: while checking a for R=4',
        ),
        R=4,
    ),
    Case(
        'division_by_a_default',  # k=0 came from the default: the note said only R, so k=0 showed nowhere
        'collective t(k = 0) {\n    in[r] = x[r]\n    out[r] = x[r / k]\n    copy\n}\n',
        (
            "spec.pln:3:16: error: division by zero in 'r / k'",
            '        out[r] = x[r / k]',
            '                   ^^^^^',
            'note: at r=0',
            'note: with k=0 (its default)',
            'note: while checking t for R=2',
        ),
        R=2,
    ),
    Case(
        'a_default_named_in_a_comment_is_not_read',  # the comment's j and the chunk y are no values
        'collective t(k = 0, j = 1, y = 2) {\n    in[r] = x[r]\n    out[r] = x[(r + // j\n 1) / k]\n    copy\n}\n',
        (
            "spec.pln:3:16: error: division by zero in '(r + 1) / k'",
            '        out[r] = x[(r + // j',
            '                   ^',
            'note: at r=0',
            'note: with k=0 (its default)',
            'note: while checking t for R=2',
        ),
        R=2,
    ),
    Case(
        'rank_index_param_out_of_range',
        'collective a(root = 0) {\n    in[root] = x\n    out[r] = x\n    copy\n}\n',
        (
            "spec.pln:2:8: error: rank index 'root' is -1, outside 0..1",
            '        in[root] = x',
            '           ^^^^',
            'note: while checking a for R=2, root=-1',
        ),
        R=2, params={'root': -1},
    ),
    Case(
        'arity_mismatch',
        'collective a {\n    in[r] = x[r]\n    out[r] = x[r][0]\n    copy\n}\n',
        (
            "spec.pln:3:14: error: chunk 'x' is used with 2 indices here but with 1 elsewhere (line 2)",
            '        out[r] = x[r][0]',
            '                 ^^^^^^^',
            'note: while checking a for R=4',
        ),
        R=4,
    ),
    Case(
        'division_by_zero',
        'collective a {\n    in[r] = x[r]\n    out[r] = x[r / (R - R)]\n    copy\n}\n',
        (
            "spec.pln:3:16: error: division by zero in 'r / (R - R)'",
            '        out[r] = x[r / (R - R)]',
            '                   ^^^^^^^^^^^',
            'note: at r=0',
            'note: while checking a for R=4',
        ),
        R=4,
    ),
    Case(
        'assigned_twice',
        'collective a {\n    in[r] = x[r]\n    in[0] = x[0]\n    out[r] = x[r]\n    copy\n}\n',
        (
            'spec.pln:3:5: error: in[0] is assigned twice (also at line 2)',
            '        in[0] = x[0]',
            '        ^^^^^^^^^^^^',
            'note: while checking a for R=4',
        ),
        R=4,
    ),
    Case(
        'no_output',
        'collective a {\n    in[r] = x[r]\n    copy\n}\n',
        (
            "spec.pln:1:1: error: the collective names no output chunk (add 'out[r] = ...')",
            '    collective a {',
            '    ^',
            'note: while checking a for R=4',
        ),
        R=4,
    ),
    Case(
        'where_fails',
        'collective a where R % 2 == 0 {\n    in[r] = x[r]\n    out[r] = x[r + 1 - 2 * (r % 2)]\n    copy\n}\n',
        (
            'spec.pln:1:20: error: a is not defined for R=3: it requires R % 2 == 0',
            '    collective a where R % 2 == 0 {',
            '                       ^^^^^^^^^^',
            'note: while checking a for R=3',
        ),
        R=3,
    ),
    Case(  # a default is a value in use too: without it the message has no 'k' to explain it
        'where_fails_for_a_default',
        'collective ag(k = 1) where k > 5 {\n    in[r] = x[r]\n    out[r] = x[(r + k) % R]\n    copy\n}\n',
        (
            'spec.pln:1:28: error: ag is not defined for R=3: it requires k > 5',
            '    collective ag(k = 1) where k > 5 {',
            '                               ^^^^^',
            'note: with k=1 (its default)',
            'note: while checking ag for R=3',
        ),
        R=3,
    ),
    Case(  # a given value is in the last note already
        'where_fails_for_a_given_value',
        'collective ag(k = 1, m = 0) where k > 5, m >= 0 {\n    in[r] = x[r]\n    out[r] = x[(r + k + m) % R]\n    copy\n}\n',
        (
            'spec.pln:1:35: error: ag is not defined for R=3: it requires k > 5',
            '    collective ag(k = 1, m = 0) where k > 5, m >= 0 {',
            '                                      ^^^^^',
            'note: while checking ag for R=3, k=2',
        ),
        R=3,
        params={'k': 2},
    ),
    Case(  # a loop's range starts at 0 like an index's: the note shows the shifted loop
        'negative_loop_range',
        'collective a {\n    in[r] = x[r]\n    out[r] = x[(r + v) % R] for v in -1..2\n    copy\n}\n',
        (
            'spec.pln:3:38: error: loop range -1..2 starts at -1: a loop range starts at 0 or above',
            '        out[r] = x[(r + v) % R] for v in -1..2',
            '                                         ^^^^^',
            "note: count from 0 and shift the uses: 'for v in 0..3' with 'v - 1' in place of 'v' ('%' wraps below 0: "
            "(r + v - 1) % R)",
            'note: while checking a for R=3',
        ),
        R=3,
    ),
    Case(  # ends that vary (with i, or with R): the shifted loop in their terms, not this i's numbers
        'negative_loop_range_of_an_outer_loop',
        'collective a {\n    in[r] = x[r][j] for i in 0..3 for j in i - 1..i\n    out[r] = x[r][0]\n    copy\n}\n',
        (
            'spec.pln:2:44: error: loop range i - 1..i starts at -1: a loop range starts at 0 or above',
            '        in[r] = x[r][j] for i in 0..3 for j in i - 1..i',
            '                                               ^^^^^^^^',
            "note: count from 0 and shift the uses: 'for j in 0..i - (i - 1)' with 'j + (i - 1)' in place of 'j' "
            "('%' wraps below 0)",
            'note: at r=0, i=0',
            'note: while checking a for R=3',
        ),
        R=3,
    ),
    Case(
        'negative_loop_range_of_the_world_size',
        'collective a {\n    in[r] = x[r]\n    out[r] = x[(r + v) % R] for v in -R..0\n    copy\n}\n',
        (
            'spec.pln:3:38: error: loop range -R..0 starts at -3: a loop range starts at 0 or above',
            '        out[r] = x[(r + v) % R] for v in -R..0',
            '                                         ^^^^^',
            "note: count from 0 and shift the uses: 'for v in 0..R' with 'v - R' in place of 'v' ('%' wraps below 0)",
            'note: while checking a for R=3',
        ),
        R=3,
    ),
    Case(  # empty as well: no shifted loop to suggest
        'negative_empty_loop_range',
        'collective a {\n    in[r] = x[r]\n    out[r] = x[r] for v in -1..-R\n    copy\n}\n',
        (
            'spec.pln:3:28: error: loop range -1..-R starts at -1: a loop range starts at 0 or above',
            '        out[r] = x[r] for v in -1..-R',
            '                               ^^^^^^',
            'note: while checking a for R=3',
        ),
        R=3,
    ),
    Case(
        'loop_hides_parameter',
        'collective a(k = 2) {\n    in[r] = x[r][k] for k in 0..2\n    out[r] = x[0][0]\n    copy\n}\n',
        (
            "spec.pln:2:21: error: loop variable 'k' hides the parameter of the same name",
            '        in[r] = x[r][k] for k in 0..2',
            '                        ^^^^^^^^^^^^^',
            'note: while checking a for R=4',  # about the name k, not its value: no "with k=2"
        ),
        R=4,
    ),
    Case(
        'loop_hides_rank',
        'collective a {\n    in[r] = x[r][r] for r in 0..2\n    out[r] = x[0][0]\n    copy\n}\n',
        (
            "spec.pln:2:21: error: loop variable 'r' hides the rank of the same name",
            '        in[r] = x[r][r] for r in 0..2',
            '                        ^^^^^^^^^^^^^',
            'note: while checking a for R=4',
        ),
        R=4,
    ),
    Case(
        'tabs_keep_the_caret_aligned',
        'collective a {\n\tin[r] = x[r]\n\tout[r] = y[r]\n\tcopy\n}\n',
        (
            'spec.pln:3:11: error: output chunk y[0] of rank 0 has no producer: no input names it',
            '        out[r] = y[r]',
            '                 ^^^^',
            "note: no input names any chunk called 'y'",
            'note: while checking a for R=4',
        ),
        R=4,
    ),
    Case(
        'empty_file',
        '',
        (
            "spec.pln:1:1: error: the file is empty; expected a collective such as 'collective name { in[r] = ... out[r] = ... copy }'",
        ),
        R=4,
    ),
    Case(
        'blank_file',
        '\n  // only a comment\n',
        (
            'spec.pln:1:1: error: the file holds no collective, only comments',
        ),
        R=4,
    ),
    Case(  # lark's lookahead set listed ')', ',' and '..' here, which cannot follow 'where R'
        'single_equals_in_a_condition',
        'collective a where R = 2 {\n    in[r] = x[r]\n    out[r] = x[0..R]\n    copy\n}\n',
        (
            "spec.pln:1:22: error: unexpected '='; expected '%', '*', '+', '-', '/', a comparison (==, !=, <, <=, >, >=)",
            '    collective a where R = 2 {',
            '                         ^',
            "note: a condition compares with '==' ('=' assigns, in statements)",
        ),
        R=4,
    ),
    Case(
        'with_after_where',
        'collective a where R > 1 with sizes n[R] of x {\n    in[r] = x[r]\n    out[r] = x[0..R]\n    copy\n}\n',
        (
            "spec.pln:1:26: error: unexpected keyword 'with'; expected '%', '*', '+', ',', '-', '/', '{'",
            '    collective a where R > 1 with sizes n[R] of x {',
            '                             ^^^^',
            "note: the header's clauses come in this order: collective NAME(PARAMS) with OPERANDS where CONDITIONS {",
        ),
        R=4,
    ),
    Case(
        'two_with_clauses',
        'collective a with sizes n[R] of x with sizes m[R] of x {\n    in[r] = x[r]\n    out[r] = x[0..R]\n    copy\n}\n',
        (
            "spec.pln:1:35: error: unexpected keyword 'with'; expected ',', 'where', '{'",
            '    collective a with sizes n[R] of x with sizes m[R] of x {',
            '                                      ^^^^',
            "note: declare every operand in one 'with' clause, separated by commas",
        ),
        R=4,
    ),
    Case(  # an epilogue's statements: ')' and ',' were offered, with no call open
        'operator_an_epilogue_lacks',
        'collective a with rows q {\n    in[r] = x\n    out[r] = x\n    reduce\n'
        '    epilogue rows(8) {\n        out = out % q\n    }\n}\n',
        (
            "spec.pln:6:19: error: unexpected '%'; expected '*', '+', '-', '/', ';', 'out', '}', a name",
            '            out = out % q',
            '                      ^',
        ),
        R=4,
    ),
    Case(  # the next statement's target was taken as the value: reported at its '=' on line 7
        'epilogue_value_missing_at_the_end_of_its_line',
        'collective f(hidden = 8) with rows res {\n    in[r] = x\n    out[r] = x\n    reduce\n    epilogue rows(hidden) {\n        h =\n        res = h\n        out = h\n    }\n}\n',
        (
            "spec.pln:6:12: error: missing a value after '=' at the end of the line; expected '(', '-', 'out', a decimal number, a name, a number",
            '            h =',
            '               ^',
        ),
        R=4,
    ),
    Case(  # reported at the '}' on the next line
        'epilogue_value_missing_before_the_brace',
        'collective f(hidden = 8) with rows res {\n    in[r] = x\n    out[r] = x\n    reduce\n    epilogue rows(hidden) {\n        res = out\n        out =\n    }\n}\n',
        (
            "spec.pln:7:14: error: missing a value after '=' at the end of the line; expected '(', '-', 'out', a decimal number, a name, a number",
            '            out =',
            '                 ^',
        ),
        R=4,
    ),
    Case(  # reported at the next statement's '=' on line 7
        'epilogue_operand_missing_after_an_operator',
        'collective f(hidden = 8) with rows res {\n    in[r] = x\n    out[r] = x\n    reduce\n    epilogue rows(hidden) {\n        h = out *\n        res = h\n        out = h\n    }\n}\n',
        (
            "spec.pln:6:18: error: missing a value after '*' at the end of the line; expected '(', '-', 'out', a decimal number, a name, a number",
            '            h = out *',
            '                     ^',
        ),
        R=4,
    ),
    Case(  # 'res' began a statement: "unexpected '}'; expected '='" at 7:5
        'epilogue_operator_missing_between_operands',
        'collective f(hidden = 8) with rows res {\n    in[r] = x\n    out[r] = x\n    reduce\n    epilogue rows(hidden) {\n        out = out res\n    }\n}\n',
        (
            "spec.pln:6:19: error: missing an operator before 'res'; expected '*', '+', '-', '/'",
            '            out = out res',
            '                      ^^^',
            "note: or, if 'res' starts a new statement, '=' after it",
        ),
        R=4,
    ),
    Case(  # '1e' is 1 then a name: "unexpected '}'; expected '='" at 7:5
        'epilogue_exponent_without_digits',
        'collective f(hidden = 8) with rows res {\n    in[r] = x\n    out[r] = x\n    reduce\n    epilogue rows(hidden) {\n        out = out * 1e\n    }\n}\n',
        (
            "spec.pln:6:21: error: '1e' is not a number",
            '            out = out * 1e',
            '                        ^^',
            'note: an exponent needs digits, as in 1e-6',
        ),
        R=4,
    ),
    Case(  # was "unexpected '}'; expected 'out', a name"
        'empty_epilogue',
        'collective f(hidden = 8) with rows res {\n    in[r] = x\n    out[r] = x\n    reduce\n    epilogue rows(hidden) {\n\n    }\n}\n',
        (
            'spec.pln:5:5: error: the epilogue is empty: assign out or a rows operand, or remove the epilogue',
            '        epilogue rows(hidden) {',
            '        ^^^^^^^^',
        ),
        R=4,
    ),
    Case(  # reported at the 'out' of line 3
        'layout_missing_at_the_end_of_its_line',
        'collective a {\n    in[r] =\n    out[r] = x[0..R]\n    copy\n}\n',
        (
            "spec.pln:2:12: error: missing a value after '=' at the end of the line; expected a name",
            '        in[r] =',
            '               ^',
        ),
        R=4,
    ),
    Case(  # reported at the 'out' of line 3
        'layout_cut_after_a_comma',
        'collective a {\n    in[r] = x[r],\n    out[r] = x[0..R]\n    copy\n}\n',
        (
            "spec.pln:2:18: error: missing a value after ',' at the end of the line; expected a name",
            '        in[r] = x[r],',
            '                     ^',
        ),
        R=4,
    ),
    Case(  # reported at the '{' of line 2
        'condition_cut_after_a_comma',
        'collective a where R > 1,\n{\n    in[r] = x[r]\n    out[r] = x[0..R]\n    copy\n}\n',
        (
            "spec.pln:1:26: error: missing a value after ',' at the end of the line; expected '(', '-', a name, a number",
            '    collective a where R > 1,',
            '                             ^',
        ),
        R=4,
    ),
    Case(  # reported at the 'copy' of line 4
        'loop_cut_after_for',
        'collective a {\n    in[r] = x[r]\n    out[r] = x[i] for\n    copy\n}\n',
        (
            "spec.pln:3:22: error: the line ends after 'for'; expected a name",
            '        out[r] = x[i] for',
            '                         ^',
        ),
        R=4,
    ),
    Case(  # '[r]' read as an index of the x above: "unexpected '='" at 3:9
        'statement_without_its_buffer',
        'collective a {\n    in[r] = x[r]\n    [r] = x[0..R]\n    copy\n}\n',
        (
            "spec.pln:3:5: error: missing 'in' or 'out' before '['; a statement reads 'in[RANK] = LAYOUT' or 'out[RANK] = LAYOUT'",
            '        [r] = x[0..R]',
            '        ^',
        ),
        R=4,
    ),
    Case(
        'epilogue_before_the_operation',
        'collective f(hidden = 8) with rows res {\n    in[r] = x\n    out[r] = x\n    epilogue rows(hidden) {\n        res = out\n    }\n    reduce\n}\n',
        (
            "spec.pln:4:5: error: unexpected keyword 'epilogue'; expected ',', ';', '[', 'copy', 'for', 'in', 'out', 'reduce'",
            '        epilogue rows(hidden) {',
            '        ^^^^^^^^',
            "note: the epilogue comes after the operation: '... reduce  epilogue rows(E) { ... }'",
        ),
        R=4,
    ),
    Case(
        'statement_after_the_operation',
        'collective a {\n    in[r] = x[r]\n    copy\n    out[r] = x[0..R]\n}\n',
        (
            "spec.pln:4:5: error: unexpected keyword 'out'; expected ';', 'epilogue', 'replicated', '}'",
            '        out[r] = x[0..R]',
            '        ^^^',
            "note: the operation ('copy' or 'reduce') comes after every 'in[...]' and 'out[...]' statement",
        ),
        R=4,
    ),
    Case(
        'non_ascii_letter_in_a_name',
        'collective a {\n    in[r] = xé[r]\n    out[r] = x[0..R]\n    copy\n}\n',
        (
            "spec.pln:2:14: error: unexpected character 'é'",
            '        in[r] = xé[r]',
            '                 ^',
            "note: names are ASCII: a letter or '_', then letters, digits or '_'",
        ),
        R=4,
    ),
    Case(
        'decimal_point_without_digits',
        'collective f(hidden = 8) with rows res {\n    in[r] = x\n    out[r] = x\n    reduce\n    epilogue rows(hidden) {\n        out = out * 1.\n    }\n}\n',
        (
            "spec.pln:6:22: error: unexpected character '.'",
            '            out = out * 1.',
            '                         ^',
            'note: a decimal number has digits after its point, as in 1.0',
        ),
        R=4,
    ),
    Case(  # reported at the next statement's 'out' before
        'epilogue_parenthesis_left_open',
        'collective f(hidden = 8) with rows res, row w {\n    in[r] = x\n    out[r] = x\n    reduce\n    epilogue rows(hidden) {\n        h = (out + res\n        out = rmsnorm(h, w, 1e-6)\n    }\n}\n',
        (
            "spec.pln:6:23: error: the '(' at 6:13 is not closed at the end of the line; expected ')'",
            '            h = (out + res',
            '                          ^',
            "note: a ')' goes here, or the line goes on",
        ),
        R=4,
    ),
    Case(  # the innermost bracket open: rmsnorm's, not one closed before it on the line
        'epilogue_call_left_open',
        'collective f(hidden = 8) with rows res, row w {\n    in[r] = x\n    out[r] = x\n    reduce\n    epilogue rows(hidden) {\n        out = rmsnorm((out), w, 1e-6\n        res = out\n    }\n}\n',
        (
            "spec.pln:6:37: error: the '(' at 6:22 is not closed at the end of the line; expected ')', ','",
            '            out = rmsnorm((out), w, 1e-6',
            '                                        ^',
            "note: a ')' goes here, or the line goes on",
        ),
        R=4,
    ),
    Case(  # a keyword in capitals is a name to the lexer: the note says case is the difference
        'keyword_in_capitals',
        'collective a {\n    in[r] = x[r]\n    out[r] = x[0..R]\n    Copy\n}\n',
        (
            "spec.pln:4:5: error: unexpected name 'Copy'; expected ',', ';', '[', 'copy', 'for', 'in', 'out', 'reduce'",
            '        Copy',
            '        ^^^^',
            "note: keywords are lower case: 'copy'",
        ),
        R=4,
    ),
    Case(
        'operand_kind_in_capitals',
        'collective f(hidden = 8) with Rows res {\n    in[r] = x\n    out[r] = x\n    reduce\n}\n',
        (
            "spec.pln:1:31: error: unexpected name 'Rows'; expected 'row', 'rows', 'scalar', 'sizes'",
            '    collective f(hidden = 8) with Rows res {',
            '                                  ^^^^',
            "note: keywords are lower case: 'rows'",
        ),
        R=4,
    ),
    Case(
        'floor_division_written_as_python',  # '//' comments out the rest of the line: say so, not only "end of file"
        'collective a { in[r] = x[r] out[r] = x[r // 2] copy }\n',
        (
            "spec.pln:1:41: error: unexpected end of file; expected '%', '*', '+', '-', '..', '/', ']'",
            '    collective a { in[r] = x[r] out[r] = x[r // 2] copy }',
            '                                            ^',
            "note: the '//' at 1:42 starts a comment, to the end of the line, so the parser did not read what "
            "follows it; division is '/', and it already floors (as Python's '//' does)",
        ),
        R=4,
    ),
    Case(
        'floor_division_in_a_condition',
        'collective a where R // 2 == 1 {\n    in[r] = x[r]\n    out[r] = x[r]\n    copy\n}\n',
        (
            "spec.pln:2:5: error: unexpected keyword 'in'; expected a comparison (==, !=, <, <=, >, >=)",
            '        in[r] = x[r]',
            '        ^^',
            "note: the '//' at 1:22 starts a comment, to the end of the line, so the parser did not read what "
            "follows it; division is '/', and it already floors (as Python's '//' does)",
        ),
        R=4,
    ),
    Case(
        'comment_after_an_unclosed_range',  # a prose comment: '/' in its place parses no further, so no note
        'collective a {\n    in[r] = x[0..R   // all\n    out[r] = x[r]\n    copy\n}\n',
        (
            "spec.pln:2:19: error: the '[' at 2:14 is not closed at the end of the line; expected ']'",
            '        in[r] = x[0..R   // all',
            '                      ^',
            "note: a ']' goes here, or the line goes on",
        ),
        R=4,
    ),
    Case(
        'range_with_one_point',
        'collective a {\n    in[r] = x[r]\n    out[r] = x[0.R]\n    copy\n}\n',
        (
            "spec.pln:3:17: error: unexpected character '.'",
            '        out[r] = x[0.R]',
            '                    ^',
            'note: a range has two points, as in 0..R',
        ),
        R=4,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_rendered_diagnostic(case):
    assert diagnose(case.source, case.R, case.params).render() == "\n".join(case.expected)


def test_the_table_is_large_enough():
    assert len(CASES) >= 15 and len({case.name for case in CASES}) == len(CASES)


def test_str_is_the_rendered_text():
    error = diagnose("collective a { in[r] = x[r] out[r] = y copy }", 2)
    assert str(error) == error.render()
    assert error.message == "output chunk y of rank 0 has no producer: no input names it"
    assert (error.span.line, error.span.column) == (1, 38)


def test_with_note_keeps_message_and_span():
    error = PurlinError("bad", None, ("first",)).with_note("second")
    assert error.notes == ("first", "second") and error.render() == "error: bad\nnote: first\nnote: second"


def test_with_note_keeps_each_subclass_fields():
    from purlinc.runtime.errors import HeapExhaustedError, PurlinTimeoutError, ResidencyError
    from purlinc.snac.verify.common import VerificationError

    cases = [
        (PurlinTimeoutError("t", record={"rank": 1, "step": 4}), {"record": {"rank": 1, "step": 4}}),
        (HeapExhaustedError("h", requested=64, available=32), {"requested": 64, "available": 32}),
        (ResidencyError("r", device=3, needed=40, limit=32), {"device": 3, "needed": 40, "limit": 32}),
        (VerificationError("v", rank=1, channel=2, step=3, call=1), {"rank": 1, "channel": 2, "step": 3, "call": 1}),
    ]
    for error, fields in cases:
        noted = error.with_note("while calling")
        assert type(noted) is type(error) and noted.notes == ("while calling",) and error.notes == ()
        assert {k: getattr(noted, k) for k in fields} == fields, type(error).__name__


def test_span_past_the_end_of_its_line_gets_one_caret():
    source = Source("f.pln", "ab\ncd\n")
    error = PurlinError("m", Span(source, 2, 3, 2, 4))
    assert error.render() == "f.pln:2:3: error: m\n    cd\n      ^"


def test_multi_line_span_gets_one_caret():
    source = Source("f.pln", "abc\ndef\n")
    assert PurlinError("m", Span(source, 1, 2, 2, 1)).render() == "f.pln:1:2: error: m\n    abc\n     ^"


def test_crlf_and_form_feeds_do_not_shift_lines():
    error = diagnose("collective a {\r\n\x0c  in[r] = x[r]\r\n  out[r] = y[r]\r\n  copy\r\n}\r\n", 2)
    assert error.render().splitlines()[:3] == [
        "spec.pln:3:12: error: output chunk y[0] of rank 0 has no producer: no input names it",
        "      out[r] = y[r]",
        "               ^^^^",
    ]


# --- files that cannot be read as .pln text -------------------------------------------------

def test_file_that_does_not_exist(tmp_path):
    with pytest.raises(PurlinError) as info:
        parse_file(tmp_path / "missing.pln")
    assert info.value.render() == f"error: no such file: {tmp_path / 'missing.pln'}"


def test_directory(tmp_path):
    with pytest.raises(PurlinError) as info:
        read_source(tmp_path)
    assert info.value.render() == f"error: {tmp_path} is a directory, not a .pln file"


def test_binary_file(tmp_path):
    path = tmp_path / "a.pln"
    path.write_bytes(b"collective\x00\x01\x02")
    with pytest.raises(PurlinError) as info:
        parse_file(path)
    assert info.value.render().splitlines() == [
        f"{path}:1:11: error: not a text file: it contains a NUL byte",
        "    collective\ufffd\ufffd\ufffd",
        "              ^",
    ]


def test_file_that_is_not_utf8(tmp_path):
    path = tmp_path / "a.pln"
    path.write_bytes(b"// caf\xc3\xa9\ncollective a \xff{ }")
    with pytest.raises(PurlinError) as info:
        parse_file(path)
    assert info.value.render().splitlines() == [
        f"{path}:2:14: error: not UTF-8 text: byte 0xff (at byte offset 22)",
        "    collective a \ufffd{ }",
        "                 ^",
    ]


def test_nul_in_text_given_directly():
    with pytest.raises(PurlinError) as info:
        parse("collective a\x00")
    assert info.value.render().splitlines()[0] == "<string>:1:13: error: not a text file: it contains a NUL byte"


def test_empty_file_on_disk(tmp_path):
    path = tmp_path / "empty.pln"
    path.write_text("")
    with pytest.raises(PurlinError) as info:
        parse_file(path)
    assert info.value.render().startswith(f"{path}:1:1: error: the file is empty")


# A continuation line with a slip of its own keeps the plain message at that slip: only a line
# that starts something new (a statement, the operation, '}') moves the report back to the end
# of a line cut short.  And a '.' after a name ending in digits (`x1.5`) is no number's point.
@pytest.mark.parametrize("source, line, column, message, notes", [
    ("collective a {\n  in[r] = x[r]\n  out[r] = x[0],\n           [1]\n  copy\n}", 4, 12, "unexpected '['", ()),
    ("collective a {\n  in[r] =\n      = x[r]\n  out[r] = x copy\n}", 3, 7, "unexpected '='", ()),
    ("collective a(E=4) with rows res {\n  in[r] = x out[r] = x reduce\n  epilogue rows(E) {\n    out = out *\n"
     "        * res\n  }\n}", 5, 9, "unexpected '*'", ()),
    ("collective a {\n  in[r] = x1.5\n  out[r] = x copy\n}", 2, 13, "unexpected character '.'", ()),
    ("collective a(E=4) { in[r] = x out[r] = x reduce epilogue rows(E) { out = out * 1.e-3 } }", 1, 81,
     "unexpected character '.'", ("a decimal number has digits after its point, as in 1.0e-3",)),
])
def test_a_continuation_keeps_its_own_location(source, line, column, message, notes):
    with pytest.raises(PurlinError) as info:
        parse(source)
    error = info.value
    assert (error.span.line, error.span.column) == (line, column)
    assert error.message.startswith(message) and tuple(error.notes) == notes


def test_a_long_chunk_name_is_cut_in_messages():
    """Chunk names went into messages whole: 1,000 indices made a 3,000-character first line."""
    deep = "[0]" * 200
    for text, says in ((f"collective c {{ in[r] = x[r] out[r] = y{deep} copy }}", "output chunk y[0][0]"),
                       (f"collective c {{ in[r] = y{deep}[r] out[r] = y{deep}[r + 1] copy }}", "output chunk y[0]")):
        with pytest.raises(PurlinError) as caught:
            check(parse(text, "long.pln"), 2)
        first = caught.value.message
        assert first.startswith(says) and "..." in first and len(first) < 160, first
        assert all(len(note) < 200 for note in caught.value.notes)


def _quoted_diagnostics():
    """Every ``FILE.pln:LINE:COL: error: ...`` the README and docs/ quote, with the two lines
    under it (the source line and the caret), as (document, first line, source, caret)."""
    root = Path(__file__).resolve().parent.parent
    found = []
    for doc in (root / "README.md", *sorted((root / "docs").glob("*.md"))):
        lines = doc.read_text(encoding="utf-8").splitlines()
        for i, line in enumerate(lines[:-2]):
            if re.match(r"\S+\.pln:\d+:\d+: error: ", line):
                found.append(pytest.param(line, lines[i + 1], lines[i + 2], id=f"{doc.name}:{i + 1}"))
    return found


@pytest.mark.parametrize("first, shown, caret", _quoted_diagnostics())
def test_quoted_diagnostics_are_laid_out_as_rendered(first, shown, caret):
    """LANGUAGE.md quoted an epilogue refusal at 4:5 with its source line and caret at the
    margin, where the CLI indents the file's line by four more: a quoted diagnostic's source
    and caret lines are what render() makes of that line at that location."""
    line, column = map(int, re.match(r"\S+\.pln:(\d+):(\d+): ", first).groups())
    assert shown.startswith("    "), shown
    width = len(caret.strip())
    source = Source("doc.pln", "\n" * (line - 1) + shown[4:])
    rendered = PurlinError("m", Span(source, line, column, line, column + width)).render().splitlines()
    assert rendered[1:3] == [shown, caret]


def test_quoted_diagnostics_are_found():
    assert len(_quoted_diagnostics()) >= 3  # README's bad.pln, LANGUAGE.md's shift.pln and fused.pln
