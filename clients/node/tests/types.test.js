'use strict';
// The package's .d.ts files compile against a TypeScript program that uses every entry point.

const test = require('node:test');
const assert = require('node:assert/strict');
const path = require('node:path');
const { execFileSync } = require('node:child_process');

test('the types compile (tsc --strict) in a program using every entry point', () => {
  const tsc = require.resolve('typescript/bin/tsc');
  const args = [tsc, '--noEmit', '--strict', '--esModuleInterop', '--skipLibCheck', 'false',
    '--module', 'node16', '--moduleResolution', 'node16', '--target', 'es2022',
    path.join(__dirname, 'types-usage.ts')];
  let output = '';
  try {
    execFileSync(process.execPath, args, { cwd: __dirname, encoding: 'utf8' });
  } catch (err) {
    output = `${err.stdout}${err.stderr}`;
  }
  assert.equal(output, '');
});
