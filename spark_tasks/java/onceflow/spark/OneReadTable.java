package onceflow.spark;

import java.util.EnumSet;
import java.util.Set;

import org.apache.spark.sql.connector.catalog.SupportsRead;
import org.apache.spark.sql.connector.catalog.TableCapability;
import org.apache.spark.sql.connector.read.Batch;
import org.apache.spark.sql.connector.read.Scan;
import org.apache.spark.sql.connector.read.ScanBuilder;
import org.apache.spark.sql.types.StructType;
import org.apache.spark.sql.util.CaseInsensitiveStringMap;

/**
 * What onceflow's readers' tables share: each is one read, so the table is its own scan
 * builder, scan and batch; a reader names itself, its schema, its input partitions and the
 * factory of their readers.
 */
@SuppressWarnings("deprecation")  // Table.schema(): what Spark 4.2 still reads
abstract class OneReadTable implements SupportsRead, Scan, ScanBuilder, Batch {
  @Override
  public Set<TableCapability> capabilities() {
    return EnumSet.of(TableCapability.BATCH_READ);
  }

  @Override
  public ScanBuilder newScanBuilder(CaseInsensitiveStringMap options) {
    return this;
  }

  @Override
  public Scan build() {
    return this;
  }

  @Override
  public StructType readSchema() {
    return schema();
  }

  @Override
  public Batch toBatch() {
    return this;
  }
}
