# What a reviewer checks by hand, checked on every run: the library exports
# only prefixed names (PostgreSQL loads it with RTLD_GLOBAL, where a bare
# global would collide with another library's), and the install scripts use
# no operator that search_path could resolve.

use strict;
use warnings FATAL => 'all';
use PostgreSQL::Test::Utils;
use Test::More;

my ($pkglibdir) = run_command([ 'pg_config', '--pkglibdir' ]);
chomp $pkglibdir;
my $library = "$pkglibdir/idempotency.so";
ok(-f $library, "the library is installed: $library");

# The linker's own symbols, and those PostgreSQL looks up by name.
my %expected = map { $_ => 1 } qw(_init _fini __bss_start _edata _end _PG_init Pg_magic_func);
my ($nm) = run_command([ 'nm', '-D', '--defined-only', $library ]);
my @bare;
for my $line (split /\n/, $nm)
{
	my (undef, $type, $name) = split ' ', $line;
	next unless defined $name;
	next if $expected{$name};
	next if $name =~ /^(?:pg_finfo_)?(?:idem_|idempotency_)/;
	push @bare, $name;
}
is(join(' ', @bare), '', 'every exported symbol is prefixed idem_ or idempotency_');

# Every operator in the install scripts is written OPERATOR(pg_catalog.x).
for my $script (glob('sql/idempotency*.sql'))
{
	my $sql = slurp_file($script);
	$sql =~ s/^\\.*$//mg;                          # psql meta-commands
	$sql =~ s{/\*.*?\*/}{}sg;                      # block comments
	$sql =~ s/--.*$//mg;                           # comments
	$sql =~ s/\$\$.*?\$\$//sg;                     # function bodies
	$sql =~ s/'(?:[^']|'')*'//g;                   # string literals
	$sql =~ s/"[^"]*"//g;                          # quoted identifiers
	$sql =~ s/OPERATOR\(pg_catalog\.[^)]+\)//g;    # qualified operators
	$sql =~ s/::/ /g;                              # casts
	my @bare_ops = $sql =~ /([=<>!~+\-|&^%\/#@]+)/g;
	is(join(' ', @bare_ops), '', "$script: no unqualified operator");
}

done_testing();
